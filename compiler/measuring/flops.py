"""Floating-point work of a model at one bucket: the multiply-adds of its
contractions (Conv, ConvTranspose, MatMul, Gemm), counted as 2 FLOPs each.
A quantized model's integer contractions (MatMulInteger, ConvInteger,
QLinearConv, QLinearMatMul, QGemm) count alike, as 2 operations each.

Elementwise ops are left out, as in the usual GFLOP/s figures of convnets
and transformers: they are memory-bound and a small share of the FLOPs.
Shapes come from ONNX shape inference with data propagation after the
bucket's sizes are written into the inputs.
"""

from __future__ import annotations

import math

import onnx

from ..models.qoperator import qoperator_as_qdq
from ..models.signature import fix_input_shapes


def _shapes(model: onnx.ModelProto) -> dict[str, list[int | None]]:
    shapes: dict[str, list[int | None]] = {}
    graph = model.graph
    for value in [*graph.input, *graph.value_info, *graph.output]:
        tensor = value.type.tensor_type
        if tensor.HasField("shape"):
            shapes[value.name] = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
    for init in graph.initializer:
        shapes[init.name] = list(init.dims)
    return shapes


def _attribute(node: onnx.NodeProto, name: str, default):
    for attr in node.attribute:
        if attr.name == name:
            return onnx.helper.get_attribute_value(attr)
    return default


def _known(shape) -> bool:
    return shape is not None and all(isinstance(d, int) and d > 0 for d in shape)


# An integer contraction's float form: the op it computes, and where its weight input is.
_INTEGER_FORMS = {
    "ConvInteger": ("Conv", 1),
    "QLinearConv": ("Conv", 3),
    "MatMulInteger": ("MatMul", 1),
    "QLinearMatMul": ("MatMul", 3),
    "QGemm": ("Gemm", 3),
}


def _node_macs(node: onnx.NodeProto, shapes: dict) -> int | None:
    """Multiply-adds of one contraction node, ``None`` when a shape is unknown."""
    out = shapes.get(node.output[0]) if node.output else None
    op_type, weight_input = _INTEGER_FORMS.get(node.op_type, (node.op_type, 1))
    if op_type in ("Conv", "ConvTranspose"):
        weight = shapes.get(node.input[weight_input])
        if not (_known(out) and _known(weight)):
            return None
        if op_type == "Conv":  # every output element: (C / group) * kh * kw products
            return math.prod(out) * math.prod(weight[1:])
        data = shapes.get(node.input[0])  # every input element scatters to (M / group) * kh * kw outputs
        return math.prod(data) * math.prod(weight[1:]) if _known(data) else None
    if op_type in ("MatMul", "Gemm"):
        a = shapes.get(node.input[0])
        if not (_known(out) and _known(a)):
            return None
        transposed = op_type == "Gemm" and _attribute(node, "transA", 0)
        k = a[0] if transposed else a[-1]
        return math.prod(out) * k
    return 0


def model_flops(model: onnx.ModelProto, bucket: dict[str, tuple]) -> tuple[int, int]:
    """(FLOPs of the contractions counted, contraction nodes whose shapes stayed unknown).

    A graph whose shapes inference cannot follow (PP-OCR rec's Shape -> Reshape chains)
    counts fully once onnxsim has folded it for the bucket, as the compiler does. A QOperator graph is
    counted in its QDQ spelling: shape inference knows no ``com.microsoft`` op.
    """
    return _count(fix_input_shapes(qoperator_as_qdq(model) or model, bucket))


def _count(model: onnx.ModelProto) -> tuple[int, int]:
    inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    shapes = _shapes(inferred)
    total = unknown = 0
    for node in inferred.graph.node:
        macs = _node_macs(node, shapes)
        if macs is None:
            unknown += 1
        else:
            total += 2 * macs
    return total, unknown


def node_flops(model: onnx.ModelProto) -> dict[str, int]:
    """FLOPs (2x the multiply-adds) of each contraction node whose shapes are known, by node name."""
    shapes = _shapes(model)
    found = {}
    for node in model.graph.node:
        macs = _node_macs(node, shapes)
        if macs:
            found[node.name or node.output[0]] = 2 * macs  # unnamed: by its first output, as the importer
    return found
