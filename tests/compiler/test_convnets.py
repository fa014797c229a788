"""The zoo's CI-sized slice (``tests/convnets.py``): each convnet family's blocks compiled for real,
verified against ONNX Runtime, every kernel scheduled by a rule (none left as naive loops)."""

from __future__ import annotations

import pytest

from compiler.build import compile_bucket
from compiler.model import load_model
from compiler.store import ArtifactStore
from compiler.target import resolve_target
from tests import convnets

TARGET = resolve_target("llvm")


# Every conv of these blocks fills whole channel blocks (of 8 or 16 lanes) but the segmentation head's
# 4-channel one, and the first layer's 3 input channels make a block of their own.
NCHW_CONVS = {"residual": 0, "mobile": 0, "branches": 1}


@pytest.mark.parametrize("build", [convnets.residual_model, convnets.mobile_model, convnets.branches_model],
                         ids=["residual", "mobile", "branches"])  # fmt: skip
def test_every_conv_kind_compiles_blocked_verifies_and_is_scheduled(tmp_path, build):
    model = load_model(build(), max_bytes=1 << 24)
    # 56x56: maps of 28, 14 and 7, whose rows fill no two whole vectors (those stay NCHW: layout.py).
    manifest = compile_bucket(model, {"x": (2, 3, 56, 56)}, TARGET, ArtifactStore(tmp_path)).manifest
    assert manifest.verified, manifest.verification
    assert manifest.schedules and manifest.unscheduled == [], manifest.schedules
    convs = {name: rule for name, rule in manifest.schedules.items() if "conv2d" in name}
    # The contraction rule takes every conv: ResNet's strided shortcut with the residual add in front
    # of it was left to the row-reduction rule (122x ONNX Runtime's time on ResNet-50's).
    assert convs and set(convs.values()) == {"Contraction"}, convs
    # Channel-blocked (compiler/tvm/layout.py): regular, strided, 1x1, depthwise, grouped, dilated, the
    # first layer, squeeze-excitation's 1x1 convs on a 1x1 map.
    unblocked = [name for name in convs if "conv2d_nchwc" not in name]
    assert len(unblocked) == NCHW_CONVS[build.__name__.removesuffix("_model")], convs
    # Their weights are blocked once per model version, not per request.
    assert manifest.weight_transform is not None
