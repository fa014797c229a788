"""Ops whose shapes over a symbolic dim TVM's ONNX frontend gets wrong, imported as ONNX Runtime runs them
(``compiler/tvm/onnx_import.py``): a pool over a map shorter than its window, and a Concat of two levels
whose dims agree at some sizes only. Tiny models, real compiles, checked against ONNX Runtime."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper, numpy_helper

from compiler.building.build import compile_bucket, open_kernel
from compiler.building.target import resolve_target
from compiler.models.model import load_model
from compiler.running.engines import OrtEngine
from compiler.storage.store import KernelStore
from tests.synthetic import make_model, value

TARGET = resolve_target("llvm")


@pytest.fixture
def store(tmp_path):
    return KernelStore(tmp_path / "kernels")


def pool_model(op: str) -> bytes:
    """A 2x2, stride-2 pool then a global average over x[1, 4, h, 10]: PP-OCR cls's head, whose map is one
    row high at input heights 17..32."""
    nodes = [
        helper.make_node(op, ["x"], ["pooled"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("GlobalAveragePool", ["pooled"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "pool", [value("x", "float32", [1, 4, "h", 10])], [value("y", "float32", [1, None, None, None])]
    )
    return make_model(graph).SerializeToString()


def concat_levels_model() -> bytes:
    """Two stride-2 convs over x[1, 4, h, 8], the deeper map upsampled 2x and joined to the shallower one by
    channel: the two maps are as high only where ``(h - 1) // 2`` is odd (ONNX Runtime refuses other h)."""
    rng = np.random.default_rng(11)

    def weight(name: str, shape: tuple[int, ...]):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)

    conv = {"kernel_shape": [3, 3], "strides": [2, 1], "pads": [1, 1, 1, 1]}
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], **conv),
        helper.make_node("Conv", ["c1", "w2"], ["c2"], **conv),
        helper.make_node("Resize", ["c2", "", "scales"], ["up"], mode="nearest"),
        helper.make_node("Concat", ["up", "c1"], ["joined"], axis=1),
        helper.make_node("Conv", ["joined", "w3"], ["y"], kernel_shape=[1, 1]),
    ]
    initializer = [
        weight("w1", (4, 4, 3, 3)),
        weight("w2", (4, 4, 3, 3)),
        weight("w3", (2, 8, 1, 1)),
        numpy_helper.from_array(np.array([1, 1, 2, 1], np.float32), "scales"),
    ]
    inputs, outputs = [value("x", "float32", [1, 4, "h", 8])], [value("y", "float32", [1, None, None, None])]
    return make_model(helper.make_graph(nodes, "levels", inputs, outputs, initializer)).SerializeToString()


def _matches_onnxruntime(kernel, reference, heights, width: int) -> None:
    for h in heights:
        x = {"x": np.random.default_rng(h).standard_normal((1, 4, h, width)).astype(np.float32)}
        want = reference.run(x)["y"]
        assert np.isfinite(want).all()
        np.testing.assert_allclose(kernel.run(x)["y"], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("op", "bucket"),
    [
        ("MaxPool", {"x": (1, 4, "h@1..24", 10)}),
        ("AveragePool", {"x": (1, 4, "h@1..24", 10)}),
        ("MaxPool", {"x": (1, 4, 1, 10)}),
    ],
    ids=["max-dynamic", "average-dynamic", "max-static"],
)
def test_a_pool_over_a_map_shorter_than_its_window_answers_as_onnxruntime(store, op, bucket):
    """At h = 1 ONNX Runtime pools the one row (its output size divides toward zero, its window is
    clipped); TVM's floor division left no row, and the average over none was NaN."""
    data = pool_model(op)
    model = load_model(data, max_bytes=1 << 20)
    symbolic = isinstance(bucket["x"][2], str)
    sizes = {"h@1..24": [1, 2, 3, 24]} if symbolic else None
    outcome = compile_bucket(model, bucket, TARGET, store, verify_sizes=sizes)
    assert outcome.manifest.verified is True, outcome.manifest.verification
    kernel = open_kernel(model, outcome, store)
    _matches_onnxruntime(kernel, OrtEngine(data), [1, 5, 17] if symbolic else [1], 10)


def test_a_concat_of_levels_that_agree_at_some_heights_imports_and_refuses_the_others(store):
    """A plain symbolic height (no step): the frontend gave the Concat no shape and the upsample before the
    next layer failed (``object of type 'NoneType' has no len()``). Its inputs are cast to one shape now,
    checked at run time: the kernel answers where ONNX Runtime does and refuses where it refuses."""
    data = concat_levels_model()
    model = load_model(data, max_bytes=1 << 20)
    outcome = compile_bucket(model, {"x": (1, 4, "h", 8)}, TARGET, store, verify_sizes={"h": [7, 11, 32]})
    assert outcome.manifest.verified is True, outcome.manifest.verification
    kernel, reference = open_kernel(model, outcome, store), OrtEngine(data)
    _matches_onnxruntime(kernel, reference, [3, 15, 64], 8)
    x = {"x": np.zeros((1, 4, 9, 8), np.float32)}  # (9 - 1) // 2 = 4: the maps are 6 and 5 rows high
    with pytest.raises(Exception):  # noqa: B017 - ONNX Runtime's error and the VM's are their own types
        reference.run(x)
    with pytest.raises(Exception):  # noqa: B017
        kernel.run(x)


def test_a_size_both_refuse_verifies_as_agreement_and_sizes_none_accepts_verify_nothing(store):
    """YOLOv8n's planned sizes include heights its levels never meet at (257): where the kernel refuses a
    size ONNX Runtime refuses too, they agree, and the sizes both answer are compared; where ONNX Runtime
    refuses every size, nothing was verified."""
    model = load_model(concat_levels_model(), max_bytes=1 << 20)
    outcome = compile_bucket(model, {"x": (1, 4, "h", 8)}, TARGET, store, verify_sizes={"h": [7, 9, 11]})
    assert outcome.manifest.verified is True, outcome.manifest.verification
    assert "refused by both at x=1x4x9x8" in outcome.manifest.verification
    nothing = compile_bucket(model, {"x": (1, 4, "h", 8)}, TARGET, store, verify_sizes={"h": [9, 13]})
    assert nothing.manifest.verified is False
    assert "ONNX Runtime refuses every size verified" in nothing.manifest.verification
