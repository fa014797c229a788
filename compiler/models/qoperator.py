"""The QOperator form of a statically quantized model (``QLinearConv``, ``QLinearMatMul`` and ONNX Runtime's
``QLinearAdd``, ``QLinearGlobalAveragePool``, ``QGemm``), spelled as the QDQ form it means: each op's
integer inputs dequantized, the float op, its output quantized again. The compiled tier then keeps the
convs in integers as it does a QDQ graph's (``compiler.tvm.integer_conv``); ONNX Runtime still runs the
model as uploaded, and verification compares the two.

``QLinearConv(x, sx, zx, w, sw, zw, sy, zy, B)`` is ``Q(Conv(DQ(x), DQ(w), DQ(B, sx * sw)), sy, zy)``: the
bias is int32 at the scale ``sx * sw`` (per output channel), which is computed here from the constants.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .weights import constant_value

MICROSOFT = "com.microsoft"
CONVERTIBLE = frozenset(
    {("", "QLinearConv"), ("", "QLinearMatMul"), (MICROSOFT, "QLinearAdd"), (MICROSOFT, "QLinearGlobalAveragePool"),
     (MICROSOFT, "QGemm")}
)  # fmt: skip


class _Graph:
    """The nodes of the QDQ spelling as they are written, and the constants they read."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        # Read as arrays only where a spelling needs a value (the scales): not every weight of the model.
        self._tensors = {tensor.name: tensor for tensor in graph.initializer}
        for node in graph.node:
            value = constant_value(node)
            if value is not None:
                self._tensors[node.output[0]] = value
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.count = 0

    def name(self, stem: str) -> str:
        self.count += 1
        return f"{stem}_qdq{self.count}"

    def dequantized(self, value: str, scale: str, zero: str | None, *, axis: int | None = None) -> str:
        out = self.name(value)
        inputs = [value, scale] + ([zero] if zero else [])
        attributes = {"axis": axis} if axis is not None else {}
        self.nodes.append(helper.make_node("DequantizeLinear", inputs, [out], name=out, **attributes))
        return out

    def quantized(self, value: str, scale: str, zero: str | None, out: str) -> None:
        inputs = [value, scale] + ([zero] if zero else [])
        self.nodes.append(helper.make_node("QuantizeLinear", inputs, [out], name=self.name(out)))

    def constant(self, stem: str, array: np.ndarray) -> str:
        name = self.name(stem)
        self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def float_op(self, op_type: str, inputs: list[str], out: str, scale: str, zero: str, **attributes) -> None:
        """The float op on dequantized ``inputs``, its result quantized into ``out`` (where ``scale`` is given;
        else the float result is ``out``)."""
        result = self.name(out) if scale else out
        self.nodes.append(helper.make_node(op_type, inputs, [result], name=self.name(out), **attributes))
        if scale:
            self.quantized(result, scale, zero, out)

    def value(self, name: str) -> np.ndarray | None:
        """The constant ``name`` holds, or None where it is computed."""
        tensor = self._tensors.get(name)
        return None if tensor is None else numpy_helper.to_array(tensor)

    def weight_axis(self, scale: str) -> int | None:
        """0 for a scale per output channel (a vector), None for one per tensor."""
        tensor = self._tensors.get(scale)
        return 0 if tensor is not None and int(np.prod(tensor.dims)) > 1 else None

    def bias(self, bias: str, x_scale: str, w_scale: str) -> str | None:
        """The int32 bias dequantized at ``x_scale * w_scale``; None where a scale is not a constant."""
        x_value, w_value = self.value(x_scale), self.value(w_scale)
        if x_value is None or w_value is None:
            return None
        scale = (x_value.astype(np.float32) * w_value.astype(np.float32)).ravel()
        return self.dequantized(bias, self.constant(f"{bias}_scale", scale.astype(np.float32)), None,
                                axis=0 if scale.size > 1 else None)  # fmt: skip


def _attributes(node: onnx.NodeProto, names: tuple[str, ...]) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name in names}


def _spell(node: onnx.NodeProto, graph: _Graph) -> bool:
    """Append ``node``'s QDQ spelling to ``graph``; False where it has none here."""
    i, out = list(node.input) + [""] * 9, node.output[0]
    if node.op_type in ("QLinearConv", "QGemm"):  # x, sx, zx, w, sw, zw, then (y's scale and zero, bias) in turn
        conv = node.op_type == "QLinearConv"
        y_scale, y_zero, bias = (i[6], i[7], i[8]) if conv else (i[7], i[8], i[6])
        names = (
            ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")
            if conv
            else ("alpha", "transA", "transB")
        )
        attributes = _attributes(node, names)
        per_column = 0 if conv or attributes.get("transB", 0) else 1  # the weight's axis of output channels
        axis = per_column if graph.weight_axis(i[4]) is not None else None
        inputs = [graph.dequantized(i[0], i[1], i[2]), graph.dequantized(i[3], i[4], i[5], axis=axis)]
        if bias:
            inputs.append(graph.bias(bias, i[1], i[4]))
            if inputs[-1] is None:
                return False
        graph.float_op("Conv" if conv else "Gemm", inputs, out, y_scale, y_zero, **attributes)
    elif node.op_type == "QLinearMatMul":
        if graph.weight_axis(i[4]) is not None:
            return False  # a per-column scale of the matmul's second operand: axis 1, not spelled here
        inputs = [graph.dequantized(i[0], i[1], i[2]), graph.dequantized(i[3], i[4], i[5])]
        graph.float_op("MatMul", inputs, out, i[6], i[7])
    elif node.op_type == "QLinearAdd":
        inputs = [graph.dequantized(i[0], i[1], i[2]), graph.dequantized(i[3], i[4], i[5])]
        graph.float_op("Add", inputs, out, i[6], i[7])
    elif node.op_type == "QLinearGlobalAveragePool":
        if _attributes(node, ("channels_last",)).get("channels_last", 0):
            return False
        graph.float_op("GlobalAveragePool", [graph.dequantized(i[0], i[1], i[2])], out, i[3], i[4])
    else:
        return False
    return True


def qoperator_as_qdq(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """``model`` with its QOperator ops spelled as QDQ (see the module's docstring); ``model`` itself where it
    has none, None where one of them has no QDQ spelling here (its name is then in ``integer_ops``' refusal).
    Subgraphs are not rewritten."""
    if not any((n.domain, n.op_type) in CONVERTIBLE for n in model.graph.node):
        return model
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    if opset < 13:  # DequantizeLinear's axis (a scale per channel) is opset 13's
        return None
    graph = _Graph(model.graph)
    for node in model.graph.node:
        if (node.domain, node.op_type) in CONVERTIBLE:
            if not _spell(node, graph):
                return None
        else:
            graph.nodes.append(node)
    converted = onnx.ModelProto()
    converted.CopyFrom(model)
    del converted.graph.node[:]
    converted.graph.node.extend(graph.nodes)
    converted.graph.initializer.extend(graph.initializers)
    return converted
