"""Statically quantized convolutions kept in integers: a QDQ model's ``Conv`` over a dequantized int8
activation and a dequantized int8 weight computed as an integer conv on the CPU's int8 unit.

A QDQ graph (``onnxruntime.quantization.quantize_static``) spells ``QLinearConv`` in float: the
activation is quantized and dequantized again, the weight is an int8 constant dequantized, and the conv
between them is a float one, which ONNX Runtime fuses back into an integer kernel. TVM's importer keeps
it a float conv. Here, in two steps:

1. :func:`quantized_convs`, before the layout stage: ``conv(dequantize(q, sx, zx), dequantize(W, sw, zw))``
   becomes ``conv(q - zx, W - zw)`` in int16 with int32 sums, times ``sx * sw`` per output channel (from
   the weights alone: lifted out of the request). Exact where the float conv rounds. The activation
   enters in int16 with its zero point subtracted, so the conv's zero padding is the real zero, as it is
   for the float conv. Where the products sum exactly in bytes (VNNI's ``vpdpbusd`` on any int8 weight;
   AVX2's ``vpmaddubsw`` on weights whose channel pairs keep its bound), the activation enters in uint8
   instead (``_byte_sums``). ConvertLayout then blocks it like any conv (NCHW{b}c), and carries the
   quantize steps around it as the elementwise ops they are.
2. :func:`integer_convs`, after blocking: each blocked integer conv by a weight of the model reads it
   from ``(O/b, I/b, KH, KW, b/g, b, g)`` panels (``g`` input channels innermost under ``b`` output
   channels: 2 int16 ones or 4 bytes, the layout of the dot product's operand,
   :mod:`compiler.tvm.intrinsics`), packed by the weight transform from the int8 parameter, in a product
   block that :class:`compiler.tvm.schedules.integer.IntegerConvContraction` tensorizes.

Only convs with whole blocks of input and output channels and one group are rewritten; any other conv of
the graph stays a float conv of dequantized values, as before.

Runs in the compile child only (imports TVM).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te, topi

from ..models.quantized import bytes_sum_exactly
from .main_rewrite import bound_value, int8_dequantize, integer_value, integer_weights, op_name, rewrite_main
from .panels import _static, weight_vars

INTEGER_CONV = "integer_conv"
"""The product block's name, which the schedule rule looks for."""
PAIR = 2
"""Input channels per int32 lane's product pair (``vpmaddwd``, ``vpdpwssd``)."""
BYTE_GROUP = 4
"""Input channels per int32 lane's byte products (``vpmaddubsw`` then ``vpmaddwd``, or ``vpdpbusd``)."""


@relax.expr_functor.mutator
class _QuantizedConvs(relax.PyExprMutator):
    def __init__(self, mod: tvm.ir.IRModule, block: int, exact_bytes: bool) -> None:
        super().__init__(mod)
        self.block = block
        self.exact_bytes = exact_bytes
        self.weights = integer_weights(mod)
        self.rewritten = 0

    def _exact_weight(self, weight: relax.Expr, exact: np.ndarray, zero: np.ndarray, dtype: str) -> relax.Expr:
        """``weight - zero`` in ``dtype``: a constant for a constant ``weight`` (``exact`` is its value), else
        the ops that compute it from the parameter (lifted into the weight transform)."""
        if isinstance(weight, tvm.ir.GenericConst):
            return relax.const(exact.astype(dtype))
        emit = self.builder_.emit
        difference = emit(relax.op.subtract(emit(relax.op.astype(weight, "int16")), relax.const(zero, "int16")))
        return emit(relax.op.astype(difference, dtype)) if dtype != "int16" else difference

    def _in_bytes(self, exact: np.ndarray) -> bool:
        """Whether the OIHW weight is multiplied in bytes, exactly (its pairs: of input channels)."""
        by_input = exact.transpose(1, 0, 2, 3).reshape(exact.shape[1], -1)
        return bytes_sum_exactly(by_input, exact_sums=self.exact_bytes)

    def _byte_sums(self, quantized: relax.Expr, zero: int, weight: relax.Expr, exact: np.ndarray, attrs) -> relax.Expr:
        """The conv's int32 sums from the activation in bytes: ``u = q + shift`` in uint8 (``shift`` 128 for
        an int8 ``q``, 0 for uint8), padded with ``zero + shift`` (the real zero), then ``u x W - (zero +
        shift) x sum(W)`` per output channel. The padding is an op of its own: a conv pads with 0."""
        shift = 128 if quantized.ty.dtype == "int8" else 0
        unsigned = relax.op.astype(
            relax.op.add(relax.op.astype(quantized, "int16"), relax.const(shift, "int16")), "uint8"
        )
        top, left, bottom, right = (int(p) for p in attrs.padding)
        if top or left or bottom or right:
            unsigned = relax.op.nn.pad(unsigned, [0, 0, 0, 0, top, bottom, left, right], pad_value=float(shift + zero))
        sums = self.builder_.emit(
            relax.op.nn.conv2d(unsigned, weight, attrs.strides, [0, 0, 0, 0],
                               attrs.dilation, 1, "NCHW", "OIHW", "NCHW", "int32")
        )  # fmt: skip
        taps = exact.astype(np.int32).sum(axis=(1, 2, 3)).reshape(1, -1, 1, 1)
        return self.builder_.emit(relax.op.subtract(sums, relax.const((shift + zero) * taps, "int32")))

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if op_name(call) != "relax.nn.conv2d" or call.ty.dtype != "float32":
            return call
        attrs = call.attrs
        if (attrs.data_layout, attrs.kernel_layout, attrs.out_layout) != ("NCHW", "OIHW", "NCHW") or attrs.groups != 1:
            return call
        activation, weight = (int8_dequantize(self, arg) for arg in call.args)
        value = None if weight is None else integer_value(weight.args[0], self.weights)
        if activation is None or value is None:
            return call
        shape = _static(weight.args[0])
        if shape is None or shape[0] % self.block or shape[1] % self.block:
            return call
        x_scale, x_zero = activation.args[1:]
        w_scale, w_zero = weight.args[1:]
        w_zero = bound_value(self, w_zero)
        if not isinstance(w_zero, tvm.ir.GenericConst) or _static(x_scale) not in ([], [1]):
            return call
        if _static(x_zero) not in ([], [1]) or _static(w_scale) not in ([], [1], [shape[0]]):
            return call
        zero = w_zero.value.numpy().astype(np.int16)
        if zero.ndim == 1 and zero.size == shape[0]:
            zero = zero.reshape(-1, 1, 1, 1)
        elif zero.size != 1:
            return call
        exact = value.astype(np.int16) - zero
        x_zero_value = bound_value(self, x_zero)
        if self._in_bytes(exact) and isinstance(x_zero_value, tvm.ir.GenericConst):
            in_bytes = self._exact_weight(weight.args[0], exact, zero, "int8")
            x_zero_int = int(x_zero_value.value.numpy().reshape(()))
            sums = self._byte_sums(activation.args[0], x_zero_int, in_bytes, exact, attrs)
        else:
            data = relax.op.subtract(relax.op.astype(activation.args[0], "int16"), relax.op.astype(x_zero, "int16"))
            sums = self.builder_.emit(
                relax.op.nn.conv2d(data, self._exact_weight(weight.args[0], exact, zero, "int16"), attrs.strides,
                                   attrs.padding, attrs.dilation, 1, "NCHW", "OIHW", "NCHW", "int32")
            )  # fmt: skip
        scale = self.builder_.emit(relax.op.multiply(x_scale, w_scale))
        if _static(w_scale):
            scale = self.builder_.emit(relax.op.reshape(scale, [1, -1, 1, 1]))
        self.rewritten += 1
        return self.builder_.normalize(relax.op.multiply(relax.op.astype(sums, "float32"), scale))


def quantized_convs(mod: tvm.ir.IRModule, block: int, *, exact_bytes: bool = False) -> tuple[tvm.ir.IRModule, int]:
    """``mod`` with every float conv of a dequantized int8 activation by a dequantized int8 weight of the model
    (channels in whole ``block`` s, one group) computed as an integer conv with int32 sums (see the module's
    docstring), and how many it rewrote; ``exact_bytes``: the target sums bytes exactly (VNNI)."""
    return rewrite_main(mod, lambda _main: _QuantizedConvs(mod, block, exact_bytes))


def _per_tensor(call: relax.Call) -> bool:
    return all(_static(arg) in ([], [1]) for arg in call.args[1:])


def quantize_as_elementwise(call: relax.Call) -> relax.Expr:
    """A per-tensor ``quantize`` as the elementwise ops it legalizes to (``round(x / s) + z``, clipped to the
    integer type and cast; ``round`` is LLVM's ``nearbyint`` on the CPU, ties to even as ONNX says):
    ConvertLayout has no layout rule for ``quantize``, and left as it is, a blocked QDQ model transformed
    every map back to NCHW and again around each of them."""
    out_dtype = str(call.attrs.out_dtype)
    if not _per_tensor(call) or out_dtype not in ("int8", "uint8"):
        return call
    data, scale, zero = call.args
    dtype = data.ty.dtype
    limits = np.iinfo(out_dtype)
    value = relax.op.add(relax.op.round(relax.op.divide(data, scale)), relax.op.astype(zero, dtype))
    value = relax.op.minimum(relax.op.maximum(value, relax.const(float(limits.min), dtype)),
                             relax.const(float(limits.max), dtype))  # fmt: skip
    return relax.op.astype(value, out_dtype)


def dequantized_constant(call: relax.Call) -> relax.Expr:
    """A ``dequantize`` of an integer constant (a QDQ graph's int32 bias) as the float32 constant it is, computed
    here as TVM's legalization computes it (``float32(int32(q) - zero) * scale``): FoldConstant evaluated
    each as a kernel of its own, 0.1 s apiece (3 s of BERT-base's compile)."""
    if not all(isinstance(arg, tvm.ir.GenericConst) for arg in call.args) or str(call.attrs.out_dtype) != "float32":
        return call
    data, scale, zero = (arg.value.numpy() for arg in call.args)
    if data.dtype.kind not in "iu":
        return call
    axis = int(call.attrs.axis) % data.ndim if data.ndim else 0

    def along_axis(value: np.ndarray) -> np.ndarray | None:
        if value.size == 1:
            return value.reshape(())
        if data.ndim and value.size == data.shape[axis]:
            return value.reshape([-1 if i == axis else 1 for i in range(data.ndim)])
        return None

    scale, zero = along_axis(scale), along_axis(zero)
    if scale is None or zero is None:
        return call
    difference = data.astype(np.int32) - zero.astype(np.int32)
    return relax.const((difference.astype(np.float32) * scale.astype(np.float32)).astype(np.float32))


def dequantize_as_elementwise(call: relax.Call) -> relax.Expr:
    """A per-tensor ``dequantize`` of int8/uint8 as ``(q - z) * s`` (exact in float32), for the same reason."""
    data, scale, zero = call.args
    if not _per_tensor(call) or data.ty.dtype not in ("int8", "uint8") or str(call.attrs.out_dtype) != "float32":
        return call
    difference = relax.op.subtract(relax.op.astype(data, "float32"), relax.op.astype(zero, "float32"))
    return relax.op.multiply(difference, relax.op.astype(scale, "float32"))


def blocked_conv_product(data: te.Tensor, panels: te.Tensor, strides, padding, dilation, *, widen, name: str):
    """The conv of a channel-blocked map (``N, C/b, H, W, b``) by panels ``(O/b, I/b, KH, KW, b/2, b, 2)``,
    each pair of input channels' products summed in the type ``widen`` takes both operands to: int32 for
    the integer conv, float32 for a bf16 one (:mod:`compiler.tvm.bf16`)."""
    batch, _, height, width, block = (int(d) for d in data.shape)
    out_blocks, in_blocks, kernel_h, kernel_w, pairs, _, pair = (int(d) for d in panels.shape)
    top, left, bottom, right = padding
    if any(padding):
        data = topi.nn.pad(data, [0, 0, top, left, 0], [0, 0, bottom, right, 0], name="padded")
    out_h = (height + top + bottom - (kernel_h - 1) * dilation[0] - 1) // strides[0] + 1
    out_w = (width + left + right - (kernel_w - 1) * dilation[1] - 1) // strides[1] + 1
    in_block = te.reduce_axis((0, in_blocks), name="in_block")
    row = te.reduce_axis((0, kernel_h), name="kernel_h")
    column = te.reduce_axis((0, kernel_w), name="kernel_w")
    step = te.reduce_axis((0, pairs), name="pair")
    within = te.reduce_axis((0, pair), name="within")
    return te.compute(
        (batch, out_blocks, out_h, out_w, block),
        lambda n, o, y, x, c: te.sum(
            widen(data[n, in_block, y * strides[0] + row * dilation[0], x * strides[1] + column * dilation[1],
                       step * pair + within])
            * widen(panels[o, in_block, row, column, step, c, within]),
            axis=[in_block, row, column, step, within],
        ),
        name=name,
    )  # fmt: skip


def _integer_conv(data: te.Tensor, panels: te.Tensor, strides, padding, dilation) -> te.Tensor:
    return blocked_conv_product(
        data, panels, strides, padding, dilation, widen=lambda v: v.astype("int32"), name=INTEGER_CONV
    )


def blocked_conv_weight(value: relax.Expr, lookup) -> relax.Expr:
    """The OIHW weight a blocked conv's kernel argument was transformed from (the argument of ConvertLayout's
    ``layout_transform``, a constant or a var), through the bindings ``lookup`` finds; the argument itself
    where it is none."""
    bound = lookup(value) if isinstance(value, relax.Var) else value
    if op_name(bound) == "relax.layout_transform" and bound.args:
        return bound.args[0]
    return value


def blocked_conv_geometry(call: relax.Call) -> tuple[int, list[list[int]]] | None:
    """(the channel block, [strides, padding, dilation]) of a one-group conv from a blocked map into a
    blocked map (NCHW{b}c); None for any other conv."""
    attrs = call.attrs
    data = _static(call.args[0])
    if data is None or len(data) != 5 or attrs.groups != 1:
        return None
    if attrs.data_layout != attrs.out_layout or not str(attrs.data_layout).startswith("NCHW"):
        return None
    return data[4], [[int(v) for v in values] for values in (attrs.strides, attrs.padding, attrs.dilation)]


def pack_conv_panels(exact: np.ndarray, block: int, group: int = PAIR) -> np.ndarray:
    """An OIHW integer weight (O and I multiples of ``block``) as ``(O/b, I/b, KH, KW, b/g, b, g)`` panels:
    ``group`` (g) input channels innermost under each output channel."""
    out_channels, in_channels, kernel_h, kernel_w = exact.shape
    blocked = exact.reshape(
        out_channels // block, block, in_channels // block, block // group, group, kernel_h, kernel_w
    )
    return np.ascontiguousarray(blocked.transpose(0, 2, 5, 6, 3, 1, 4))


def _conv_panels(weight: te.Tensor, block: int, group: int) -> te.Tensor:
    """:func:`pack_conv_panels` of an OIHW weight computed from the parameters."""
    out_channels, in_channels, kernel_h, kernel_w = (int(d) for d in weight.shape)
    return te.compute(
        (out_channels // block, in_channels // block, kernel_h, kernel_w, block // group, block, group),
        lambda o, i, kh, kw, p, lane, within: weight[o * block + lane, i * block + p * group + within, kh, kw],
        name="integer_conv_panels",
    )


@relax.expr_functor.mutator
class _IntegerConvs(relax.PyExprMutator):
    def __init__(self, mod: tvm.ir.IRModule, weights: set) -> None:
        super().__init__(mod)
        self.weights = weights
        self.rewritten = 0

    def _oihw_weight(self, expr: relax.Expr, dtype: str) -> relax.Expr | None:
        """The OIHW ``dtype`` constant or weight-only var ``expr`` is (or ConvertLayout's transform of)."""
        value = blocked_conv_weight(expr, self.lookup_binding)
        computed = isinstance(value, relax.Var) and value in self.weights
        from_weights = isinstance(value, tvm.ir.GenericConst) or computed
        if from_weights and value.ty.dtype == dtype and len(_static(value) or []) == 4:
            return value
        return None

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if op_name(call) != "relax.nn.conv2d" or call.ty.dtype != "int32":
            return call
        # int16 maps by int16 weights in pairs of channels; bytes by int8 weights in fours.
        group = {"int16": (PAIR, "int16"), "uint8": (BYTE_GROUP, "int8")}.get(str(call.args[0].ty.dtype))
        geometry = blocked_conv_geometry(call)
        weight = None if geometry is None or group is None else self._oihw_weight(call.args[1], group[1])
        shape = None if weight is None else _static(weight)
        if shape is None or geometry[0] % 8 or shape[0] % geometry[0] or shape[1] % geometry[0]:
            return call
        if any(geometry[1][1]) and group[0] != PAIR:  # the byte path pads with its zero ahead, not with 0
            return call
        if isinstance(weight, tvm.ir.GenericConst):
            panels = relax.const(pack_conv_panels(weight.value.numpy(), geometry[0], group[0]))
        else:  # from a parameter: packed by the weight transform
            panels = self.builder_.emit(self.builder_.call_te(
                _conv_panels, weight, geometry[0], group[0], primfunc_name_hint="integer_conv_panels"
            ))  # fmt: skip
        self.rewritten += 1
        return self.builder_.call_te(_integer_conv, call.args[0], panels, *geometry[1], primfunc_name_hint=INTEGER_CONV)


def integer_convs(mod: tvm.ir.IRModule) -> tuple[tvm.ir.IRModule, int]:
    """``mod`` with every channel-blocked integer conv by a constant weight (step 1's) computed on packed
    panels by the ``integer_conv`` product, and how many it rewrote."""
    return rewrite_main(mod, lambda main: _IntegerConvs(mod, weight_vars(main)), drop_unused=True)
