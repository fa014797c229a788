"""The per-kernel profile: a real compiled bucket's kernels beside ONNX Runtime's nodes."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper, numpy_helper

from compiler.building.build import compile_bucket, open_kernel
from compiler.building.target import resolve_target
from compiler.measuring.profile import compare_by_class, format_profile, kernel_profile, op_class, ort_profile
from compiler.models.model import load_model
from compiler.storage.store import KernelStore
from tests.synthetic import make_model, value


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("fused_conv2d36_add41_maximum8", "contraction"),
        ("fused_matmul1_add2", "contraction"),
        ("layer_norm3", "normalization"),
        ("fused_softmax_multiply", "normalization"),
        ("transpose12", "layout"),
        ("fused_add_erf_multiply", "elementwise"),
        ("fused_maximum_minimum_multiply", "elementwise"),
        ("max3", "normalization"),
        ("vm.builtin.alloc_tensor", "runtime"),
        ("FusedConv", "contraction"),
        ("ConvTranspose", "contraction"),
        ("conv2d_transpose_phases1", "contraction"),
        ("fused_conv2d_transpose_interleave_add_tir_sigmoid", "contraction"),
        ("SkipLayerNormalization", "normalization"),
        ("ReorderOutput", "layout"),
        ("Mul", "elementwise"),
    ],
)
def test_op_classes_of_tvm_kernels_and_onnxruntime_ops(name, expected):
    assert op_class(name) == expected


def _mlp() -> bytes:
    rng = np.random.default_rng(3)
    inits = [
        numpy_helper.from_array(rng.standard_normal((64, 96)).astype(np.float32), "W"),
        numpy_helper.from_array(rng.standard_normal(96).astype(np.float32), "b"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["mm"]),
        helper.make_node("Add", ["mm", "b"], ["z"]),
        helper.make_node("Relu", ["z"], ["r"]),
        helper.make_node("Softmax", ["r"], ["y"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes, "mlp", [value("x", "float32", ["n", 64])], [value("y", "float32", ["n", 96])], initializer=inits
    )
    return make_model(graph).SerializeToString()


def test_profile_times_every_kernel_and_every_onnxruntime_node(tmp_path):
    model = load_model(_mlp(), max_bytes=1 << 20)
    store = KernelStore(tmp_path / "kernels")
    bucket = {"x": (32, 64)}
    outcome = compile_bucket(model, bucket, resolve_target("llvm"), store)
    engine = open_kernel(model, outcome, store)
    inputs = {"x": np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)}

    ours = kernel_profile(engine, inputs, runs=5)
    theirs = ort_profile(model.data, inputs, runs=5, threads=1)

    kernels = {e.name: e for e in ours.entries}
    matmul = [e for e in ours.entries if "matmul" in e.name]
    assert matmul and all(e.op_class == "contraction" and e.calls == 1 and e.ms > 0 for e in matmul)
    assert any(e.op_class == "normalization" for e in ours.entries), sorted(kernels)
    assert ours.entries == sorted(ours.entries, key=lambda e: -e.ms)
    assert sum(e.share for e in ours.entries) == pytest.approx(1.0)
    assert ours.total_ms >= sum(e.ms for e in ours.entries) * 0.9
    # ONNX Runtime fuses MatMul + Add into one Gemm-like node; either way a contraction ran once a run.
    contractions = [e for e in theirs.entries if e.op_class == "contraction"]
    assert contractions and all(e.calls == 1 for e in contractions), [(e.name, e.calls) for e in theirs.entries]
    rows = {row["op_class"]: row for row in compare_by_class(ours, theirs)}
    assert rows["contraction"]["tvm_ms"] > 0 and rows["contraction"]["ort_ms"] > 0
    report = format_profile("x=32x64", ours, theirs)
    assert "contraction" in report and matmul[0].name in report
    # The engine still serves (the instrument is gone) and the profile left its results alone.
    np.testing.assert_allclose(engine.run(inputs)["y"].sum(axis=-1), 1.0, rtol=1e-5)


def test_requests_per_second_runs_callers_side_by_side():
    from compiler.measuring.timing import requests_per_second
    from compiler.running.engines import OrtEngine

    ort = OrtEngine(_mlp(), threads=1)
    inputs = {"x": np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)}
    calls = []

    class Counted:
        def run(self, arrays):
            calls.append(1)
            return ort.run(arrays)

    rates = requests_per_second({"onnxruntime": Counted()}, inputs, concurrency=3, runs=4)
    assert rates["onnxruntime"] > 0
    assert len(calls) == 1 + 3 * 4  # one warm-up, then every caller's runs
