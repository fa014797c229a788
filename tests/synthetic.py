"""Small, deterministic ONNX models for tests that need no TVM compile.

Every builder returns the serialized model (``bytes``). All but
:func:`external_data_model` pass ``onnx.checker.check_model(full_check=True)``
and load in onnxruntime (opset 17, IR version 8).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8

_ELEM_TYPES = {
    "float32": TensorProto.FLOAT,
    "float16": TensorProto.FLOAT16,
    "float64": TensorProto.DOUBLE,
    "int32": TensorProto.INT32,
    "int64": TensorProto.INT64,
    "bool": TensorProto.BOOL,
    "string": TensorProto.STRING,
}

Dims = Sequence[int | str | None]


def make_model(graph: onnx.GraphProto, *, opset: int = OPSET, check: bool = True) -> onnx.ModelProto:
    """Wrap a graph at the test opset and IR version; full-check it unless told not to."""
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="jitserve-tests")
    model.ir_version = IR_VERSION
    if check:
        onnx.checker.check_model(model, full_check=True)
    return model


def value(name: str, dtype: str, dims: Dims) -> onnx.ValueInfoProto:
    """A tensor value info; ``None`` in ``dims`` is a dim with neither dim_value nor dim_param."""
    return helper.make_tensor_value_info(name, _ELEM_TYPES[dtype], list(dims))


def add_model(dtype: str = "float32") -> bytes:
    """``y = x + x`` over ``x: [batch, 4]`` for float32, float16 or int64."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "x"], ["y"])],
        f"add_{dtype}",
        [value("x", dtype, ["batch", 4])],
        [value("y", dtype, ["batch", 4])],
    )
    return make_model(graph).SerializeToString()


def two_input_model() -> bytes:
    """``y = MatMul(a, W) + b`` with ``a, b: [batch, 8]`` float32 sharing the axis ``batch``."""
    rng = np.random.default_rng(1234)
    weight = rng.standard_normal((8, 8)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["a", "W"], ["aw"]),
            helper.make_node("Add", ["aw", "b"], ["y"]),
        ],
        "two_input",
        [value("a", "float32", ["batch", 8]), value("b", "float32", ["batch", 8])],
        [value("y", "float32", ["batch", 8])],
        initializer=[numpy_helper.from_array(weight, "W")],
    )
    return make_model(graph).SerializeToString()


def relu_model(dims: Dims, name: str = "x") -> bytes:
    """``y = Relu(x)`` with the given input dims (``None`` = unnamed dynamic dim)."""
    graph = helper.make_graph(
        [helper.make_node("Relu", [name], ["y"])],
        "relu",
        [value(name, "float32", dims)],
        [value("y", "float32", [d if isinstance(d, int) else None for d in dims])],
    )
    return make_model(graph).SerializeToString()


def unnamed_axis_model() -> bytes:
    """``y = Relu(x)`` with ``x: [<unnamed>, 6]``."""
    return relu_model([None, 6])


def unsupported_op_model() -> bytes:
    """``Det`` over ``x: [2, 3, 3]``: valid ONNX that onnxruntime runs and TVM's Relax importer lacks."""
    graph = helper.make_graph(
        [helper.make_node("Det", ["x"], ["y"])],
        "det",
        [value("x", "float32", [2, 3, 3])],
        [value("y", "float32", [2])],
    )
    return make_model(graph).SerializeToString()


def batch_mix_model() -> bytes:
    """``y = x - ReduceMean(x, axes=[0])`` over ``x: [batch, 4]``: padded rows change the mean."""
    graph = helper.make_graph(
        [
            helper.make_node("ReduceMean", ["x"], ["mean"], axes=[0], keepdims=1),
            helper.make_node("Sub", ["x", "mean"], ["y"]),
        ],
        "batch_mix",
        [value("x", "float32", ["batch", 4])],
        [value("y", "float32", ["batch", 4])],
    )
    return make_model(graph).SerializeToString()


def external_data_model(location: str = "../../etc/passwd") -> bytes:
    """``y = x + W`` where ``W`` points at external data; deliberately not checked."""
    weight = onnx.TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[4])
    weight.data_location = TensorProto.EXTERNAL
    for key, text in (("location", location), ("offset", "0"), ("length", "16")):
        weight.external_data.add(key=key, value=text)
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "W"], ["y"])],
        "external_data",
        [value("x", "float32", ["batch", 4])],
        [value("y", "float32", ["batch", 4])],
        initializer=[weight],
    )
    return make_model(graph, check=False).SerializeToString()


def slow_model(layers: int = 32, width: int = 1024) -> bytes:
    """``x: [batch, 4]`` through ``layers`` of ``Tanh(h @ W)`` with ``W: [width, width]``: slow in onnxruntime.

    About 0.35 s per request at batch 1024 on two cores (layers=32). A second
    output ``det = Det(Reshape(x, [-1, 2, 2]))`` is an operator TVM's importer
    lacks, so a compile of any bucket fails fast and onnxruntime keeps serving
    at its own speed; one weight shared by every layer keeps the file ~4 MB.
    """
    rng = np.random.default_rng(4321)
    weights = {
        "W_in": rng.standard_normal((4, width)) / 2,
        "W": rng.standard_normal((width, width)) / np.sqrt(width),
        "W_out": rng.standard_normal((width, 4)) / np.sqrt(width),
        "square": np.array([-1, 2, 2]),
    }
    nodes = [helper.make_node("MatMul", ["x", "W_in"], ["h0"])]
    for i in range(layers):
        nodes.append(helper.make_node("MatMul", [f"h{i}", "W"], [f"m{i}"]))
        nodes.append(helper.make_node("Tanh", [f"m{i}"], [f"h{i + 1}"]))
    nodes += [
        helper.make_node("MatMul", [f"h{layers}", "W_out"], ["y"]),
        helper.make_node("Reshape", ["x", "square"], ["x2x2"]),
        helper.make_node("Det", ["x2x2"], ["det"]),
    ]
    graph = helper.make_graph(
        nodes,
        "slow",
        [value("x", "float32", ["batch", 4])],
        [value("y", "float32", ["batch", 4]), value("det", "float32", ["batch"])],
        initializer=[
            numpy_helper.from_array(array.astype(np.int64 if key == "square" else np.float32), key)
            for key, array in weights.items()
        ],
    )
    return make_model(graph).SerializeToString()
