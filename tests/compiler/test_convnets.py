"""The zoo's CI-sized slice (``tests/convnets.py``): each convnet family's blocks compiled for real,
verified against ONNX Runtime, every kernel scheduled by a rule (none left as naive loops)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from compiler.building.build import compile_bucket
from compiler.building.target import resolve_target
from compiler.models.model import load_model
from compiler.storage.store import KernelStore
from compiler.tvm.schedules.base import vector_lanes
from tests import convnets

TARGET = resolve_target("llvm")


# Every conv of these blocks fills whole channel blocks (of 8 or 16 lanes) but the segmentation head's
# 4-channel one, and the first layer's 3 input channels make a block of their own. The grouped conv's
# 8 channels a group fill an AVX2 block of 8, not an AVX-512 one of 16: there it stays NCHW too.
NCHW_CONVS = {"residual": 0, "mobile": 0, "branches": 1, "convnext": 0}
NCHW_CONVS_16_LANES = {**NCHW_CONVS, "branches": 2}


@pytest.mark.parametrize(
    "build",
    [convnets.residual_model, convnets.mobile_model, convnets.branches_model, convnets.convnext_model],
    ids=["residual", "mobile", "branches", "convnext"],
)
def test_every_conv_kind_compiles_blocked_verifies_and_is_scheduled(tmp_path, build):
    model = load_model(build(), max_bytes=1 << 24)
    # 56x56: maps of 28, 14 and 7, whose rows fill no two whole vectors (those stay NCHW: layout.py).
    manifest = compile_bucket(model, {"x": (2, 3, 56, 56)}, TARGET, KernelStore(tmp_path)).manifest
    assert manifest.verified, manifest.verification
    assert manifest.schedules and manifest.unscheduled == [], manifest.schedules
    convs = {name: rule for name, rule in manifest.schedules.items() if "conv2d" in name}
    # The contraction rule takes every conv: ResNet's strided shortcut with the residual add in front
    # of it was left to the row-reduction rule (122x ONNX Runtime's time on ResNet-50's).
    assert convs and set(convs.values()) == {"Contraction"}, convs
    # Channel-blocked (compiler/tvm/layout.py): regular, strided, 1x1, depthwise, grouped, dilated, the
    # first layer, squeeze-excitation's 1x1 convs on a 1x1 map.
    unblocked = [name for name in convs if "conv2d_nchwc" not in name]
    expected = NCHW_CONVS_16_LANES if vector_lanes(tvm.target.Target(TARGET), "float32") == 16 else NCHW_CONVS
    assert len(unblocked) == expected[build.__name__.removesuffix("_model")], convs
    # Their weights are blocked once per model version, not per request.
    assert manifest.weight_outputs is not None


def test_buckets_share_one_copy_of_their_blocked_weights_and_each_runs_right(tmp_path):
    """The weight transform (OIHW -> blocked) runs once per model version: two buckets whose transform is
    the same share its result through the server's weight pool, which counts its bytes in place of the
    weights it consumed."""
    from compiler.running.engines import OrtEngine
    from server.runtime.memory.kernel_cache import WeightPool, open_tvm_engine

    model = load_model(convnets.residual_model(), max_bytes=1 << 24)
    store = KernelStore(tmp_path)
    manifests = [compile_bucket(model, {"x": (n, 3, 56, 56)}, TARGET, store).manifest for n in (1, 2)]
    assert manifests[0].weight_outputs == manifests[1].weight_outputs is not None
    pool = WeightPool(store)
    mapped = pool.get(model.digest, "llvm").nbytes
    reference = OrtEngine(convnets.residual_model())
    engines = []  # what the server's cache holds: only the kernels, which hold the version's weights
    for manifest in manifests:
        weights = pool.get(model.digest, "llvm").for_kernel(manifest)
        engines.append(open_tvm_engine(store.library_path(manifest.key), model.signature, TARGET, weights))
        del weights
        x = np.random.default_rng(manifest.bucket["x"][0]).standard_normal(manifest.bucket["x"]).astype(np.float32)
        np.testing.assert_allclose(engines[-1].run({"x": x})["y"], reference.run({"x": x})["y"], rtol=1e-3, atol=1e-4)
    # One set of blocked weights, about the size of the prepared ones, for both kernels; the prepared ones
    # the transform consumed are given back (their mapped pages), not held beside them.
    assert 0.5 * mapped < pool.total_bytes < 1.5 * mapped
    engines.clear()  # the last kernel gone, the version's weights go too
    assert pool.total_bytes == 0
