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


@pytest.mark.parametrize("build", [convnets.residual_model, convnets.mobile_model, convnets.branches_model],
                         ids=["residual", "mobile", "branches"])  # fmt: skip
def test_every_conv_kind_compiles_verifies_and_is_scheduled(tmp_path, build):
    model = load_model(build(), max_bytes=1 << 24)
    manifest = compile_bucket(model, {"x": (2, 3, 64, 96)}, TARGET, ArtifactStore(tmp_path)).manifest
    assert manifest.verified, manifest.verification
    assert manifest.schedules and manifest.unscheduled == [], manifest.schedules
    convs = {name: rule for name, rule in manifest.schedules.items() if "conv2d" in name}
    assert convs, manifest.schedules
    if build is not convnets.mobile_model:  # (squeeze-excitation's 1x1 convs on 1x1 maps are row reductions)
        # The contraction rule takes every conv: ResNet's strided shortcut with the residual add in front
        # of it was left to the row-reduction rule (122x ONNX Runtime's time on ResNet-50's).
        assert set(convs.values()) == {"Contraction"}, convs
