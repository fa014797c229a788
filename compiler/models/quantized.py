"""Quantized graphs: integer arithmetic on activations, which TVM can only run in float.

A statically quantized model (QDQ: ``QuantizeLinear`` on activations; or ``QLinearConv`` and the like) and
a dynamically quantized one (``DynamicQuantizeLinear`` then ``MatMulInteger``) compute in int8 on ONNX
Runtime's integer kernels. TVM's importer turns them into float arithmetic around every quantize and
dequantize: measured 6-32x slower than ONNX Runtime, and its results miss fp32 verification (ResNet-50
int8: "output 'logits' differs by up to 0.762") or fail to build (BERT int8 in the dynamic tier), so
every bucket's compile was spent for nothing. A model whose weights alone are quantized (a
``DequantizeLinear`` of initializers) computes in float and is not one of these: its dequantization is
weight work, done once.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from .qoperator import qoperator_as_qdq
from .weights import constant_value

_LAYOUT_OPS = frozenset({"Identity", "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze"})

_INTEGER_OPS = frozenset(
    {
        "MatMulInteger",
        "ConvInteger",
        "DynamicQuantizeLinear",
        # com.microsoft's
        "QGemm",
        "QAttention",
        "QEmbedLayerNormalization",
        "DynamicQuantizeMatMul",
        "DynamicQuantizeLSTM",
        "MatMulIntegerToFloat",
        "QOrderedMatMul",
        "QOrderedAttention",
        "QOrderedLayerNormalization",
        "QOrderedGelu",
    }
)


def _computes_in_integers(op_type: str) -> bool:
    return op_type in _INTEGER_OPS or op_type.startswith("QLinear")


def integer_ops(model: onnx.ModelProto) -> list[str]:
    """The op types of ``model``'s graph (subgraphs included) that compute on quantized activations, each
    once and sorted; empty for a float model or one whose weights alone are quantized."""
    found: set[str] = set()
    _visit(model.graph, found)
    return sorted(found)


def _visit(graph: onnx.GraphProto, found: set[str]) -> None:
    constants = {tensor.name for tensor in graph.initializer}
    constants.update(output for node in graph.node if constant_value(node) is not None for output in node.output)
    for node in graph.node:
        if _computes_in_integers(node.op_type):
            found.add(node.op_type)
        elif node.op_type == "QuantizeLinear" and node.input and node.input[0] not in constants:
            found.add(node.op_type)  # an activation quantized: static QDQ
        for attribute in node.attribute:
            for subgraph in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
                _visit(subgraph, found)


def output_steps(model: onnx.ModelProto) -> dict[str, float]:
    """The quantization step of each graph output dequantized from integers: made by a ``DequantizeLinear``
    with a constant scale (through layout ops alone), its largest scale. Outputs computed in float after
    their last dequantization have none: they are compared at fp32's tolerances."""
    graph = model.graph
    producers = {output: node for node in graph.node for output in node.output}
    constants = {tensor.name: tensor for tensor in graph.initializer}
    steps = {}
    for output in graph.output:
        node = producers.get(output.name)
        while node is not None and node.op_type in _LAYOUT_OPS and node.input:
            node = producers.get(node.input[0])
        if node is None or node.op_type != "DequantizeLinear" or len(node.input) < 2:
            continue
        scale = _constant(node.input[1], constants, producers)
        if scale is not None and scale.size and np.all(np.isfinite(scale)):
            steps[output.name] = float(np.max(np.abs(scale)))
    return steps


def _constant(name: str, initializers: dict, producers: dict) -> np.ndarray | None:
    if name in initializers:
        return numpy_helper.to_array(initializers[name])
    node = producers.get(name)
    value = constant_value(node) if node is not None else None
    return None if value is None else numpy_helper.to_array(value)


_COMPILED_INTEGER_OPS = frozenset({"DynamicQuantizeLinear", "MatMulInteger", "QuantizeLinear"})
"""What the compiled tier computes in integers (``compiler.tvm.integer_matmul``, and the convs of a QDQ
graph: ``compiler.tvm.integer_conv``); the rest of the graph runs in float, as its QDQ form spells it."""

CONV_CHANNEL_BLOCK = 8
"""A QDQ conv is computed in integers where its input and output channels come in whole blocks of this
(the AVX2 block; AVX-512's 16 is checked again when the conv is blocked)."""


BYTE_PAIR_BOUND = 128
"""``vpmaddubsw`` sums two uint8 x int8 products into an int16 lane, saturating. With activations up to 255
it is exact where, in each pair of weights it sums, the positive parts add up to at most 128 and the
negative ones to at least -128 (255 x 128 = 32640 fits int16; 255 x 129 does not). ONNX Runtime's AVX2
kernels use it on any weight, and their answers then depend on the data; 7-bit weights (``reduce_range``)
always keep the bound."""


def bytes_sum_exactly(exact: np.ndarray, *, exact_sums: bool) -> bool:
    """Whether ``exact`` (a ``K x N`` integer weight, zero point subtracted) is multiplied by uint8 activations
    exactly in bytes: int8 values, and either the unit sums byte products into int32 (``exact_sums``: VNNI's
    ``vpdpbusd``) or every pair keeps ``vpmaddubsw``'s bound (:func:`byte_pairs_fit`)."""
    if exact.min(initial=0) < -128 or exact.max(initial=0) > 127:
        return False
    return exact_sums or byte_pairs_fit(exact)


def byte_pairs_fit(exact: np.ndarray) -> bool:
    """Whether ``exact`` (a ``K x N`` integer weight, zero point subtracted) is multiplied by uint8
    activations exactly with ``vpmaddubsw``: int8 values, and in every column each pair of k it sums
    (k = 2p, 2p + 1; K even) keeps :data:`BYTE_PAIR_BOUND`."""
    depth, columns = exact.shape
    if depth % 2 or exact.min(initial=0) < -128 or exact.max(initial=0) > 127:
        return False
    pairs = exact.astype(np.int32).reshape(depth // 2, 2, columns)
    positive, negative = np.clip(pairs, 0, None).sum(axis=1), np.clip(pairs, None, 0).sum(axis=1)
    return int(positive.max(initial=0)) <= BYTE_PAIR_BOUND and int(negative.min(initial=0)) >= -BYTE_PAIR_BOUND


def integer_path_refusal(model: onnx.ModelProto) -> str | None:
    """Why the compiled tier would not keep ``model``'s integer arithmetic in integers; None where it keeps
    all of it: every integer op a ``DynamicQuantizeLinear`` or a ``MatMulInteger`` by a constant 2-D int8
    or uint8 weight of even depth, with a per-tensor zero point on its activation (a dynamically quantized
    transformer, as ``onnxruntime.quantization.quantize_dynamic`` makes them); in a static QDQ graph
    (``quantize_static``), at least one conv or matmul by a weight computed in integers (:func:`_integer_conv`,
    :func:`_integer_matmul`), the rest as the graph spells it in float. A QOperator graph is judged in its
    QDQ spelling (:mod:`compiler.models.qoperator`)."""
    model = qoperator_as_qdq(model) or model  # QLinearConv and the like, as the QDQ they mean
    ops = integer_ops(model)
    others = [op for op in ops if op not in _COMPILED_INTEGER_OPS]
    if others:
        return f"{', '.join(others)} computed in integers only by ONNX Runtime"
    graph = model.graph
    producers = {output: node for node in graph.node for output in node.output}
    constants = {tensor.name: tensor for tensor in graph.initializer}
    kept = (integer(node, producers, constants) for node in graph.node for integer in (_integer_conv, _integer_matmul))
    if "QuantizeLinear" in ops and not any(kept):
        return (
            "no conv or matmul of this QDQ graph is computed in integers by the compiled tier (a conv: one group, "
            f"an int8 weight, channels in whole blocks of {CONV_CHANNEL_BLOCK}; a matmul: by a 2-D int8 or uint8 "
            "weight of even depth)"
        )
    for node in graph.node:
        if node.op_type != "MatMulInteger":
            continue
        weight = _constant(node.input[1], constants, producers) if len(node.input) > 1 else None
        if weight is None or weight.ndim != 2 or weight.dtype not in (np.int8, np.uint8) or weight.shape[0] % 2:
            return (
                f"MatMulInteger {node.name or node.output[0]!r} multiplies by no constant 2-D int8 weight of even depth"
            )
        zero = _constant(node.input[2], constants, producers) if len(node.input) > 2 and node.input[2] else None
        if zero is not None and zero.size != 1:
            return f"MatMulInteger {node.name or node.output[0]!r} has a zero point per row of its activation"
    return None


def _integer_matmul(node: onnx.NodeProto, producers: dict, constants: dict) -> bool:
    """Whether ``node`` is a QDQ matmul ``compiler.tvm.integer_matmul`` computes in integers: a MatMul of a
    dequantized activation by a dequantized constant 2-D int8 or uint8 weight of even depth."""
    if node.op_type != "MatMul" or len(node.input) != 2:
        return False
    activation, weight = (producers.get(name) for name in node.input)
    if activation is None or weight is None:
        return False
    if activation.op_type != "DequantizeLinear" or weight.op_type != "DequantizeLinear":
        return False
    value = _constant(weight.input[0], constants, producers)
    return value is not None and value.dtype in (np.int8, np.uint8) and value.ndim == 2 and value.shape[0] % 2 == 0


def _integer_conv(node: onnx.NodeProto, producers: dict, constants: dict) -> bool:
    """Whether ``node`` is a QDQ conv ``compiler.tvm.integer_conv`` computes in integers: a Conv of one
    group over a dequantized activation and a dequantized constant int8 weight, channels in whole blocks."""
    if node.op_type != "Conv" or len(node.input) < 2:
        return False
    groups = next((attribute.i for attribute in node.attribute if attribute.name == "group"), 1)
    activation, weight = (producers.get(name) for name in node.input[:2])
    if groups != 1 or activation is None or weight is None:
        return False
    if activation.op_type != "DequantizeLinear" or weight.op_type != "DequantizeLinear":
        return False
    value = _constant(weight.input[0], constants, producers)
    return (
        value is not None
        and value.dtype == np.int8
        and value.ndim == 4
        and value.shape[0] % CONV_CHANNEL_BLOCK == 0
        and value.shape[1] % CONV_CHANNEL_BLOCK == 0
    )
