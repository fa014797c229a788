"""Channel counts padded up to whole blocks, so that every conv of a blocked model runs blocked.

A blocked conv (``layout.py``) needs its channels in whole vectors. On AVX-512 a block is 16 channels,
and MobileNetV3's 24, 40, 72, 120, 184 and 200 fill none: those convs stayed NCHW and ran 7-11x ONNX
Runtime's time on the same nodes (MobileNetV3-Large 1x3x224x224: 9.4 ms against 5.4, Intel Xeon, AVX-512).
ONNX Runtime pads a conv's output channels up to its block with zero filters (``NchwcTransformer``); this
does the same, and carries the padded map on through what works channel by channel (bias adds,
activations, depthwise convs, squeeze-excitation's pooling and gates, residual adds) into the next conv,
whose weights get zero input channels to match. Before anything that mixes channels or reads them as
they are (a reshape, a concat, a matmul, the function's outputs) the real channels are sliced back.
A strided grouped conv whose groups are narrower than a block runs with block-wide groups instead, its
weights block-diagonal (``widens_groups``).

The pad channels never reach a real one except through a conv's zero weights, and 0 x a finite value
is 0. So their values need only stay finite: each padded map carries its pad channels' value, which is
the same everywhere (it is computed from zeros and scalar constants alone), evaluated op by op as the
map is carried; where it would not be finite, or not known, the map is sliced back first.

Runs in the compile child only (imports TVM).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from .shapes import static_shape

# A conv's output is padded only where the pad costs at most half again its work (24 -> 32 on AVX-512,
# not 8 -> 16).
MAX_PADDED_SHARE = 1.5

_UNARY = {
    "relax.nn.relu": lambda a: np.maximum(a, 0),
    "relax.nn.silu": lambda a: a / (1 + np.exp(-a)),
    "relax.nn.gelu": lambda a: 0.5 * a * (1 + math.erf(a / math.sqrt(2))),
    "relax.nn.gelu_tanh": lambda a: 0.5 * a * (1 + np.tanh(0.7978845608 * (a + 0.044715 * a**3))),
    "relax.sigmoid": lambda a: 1 / (1 + np.exp(-a)),
    "relax.tanh": np.tanh,
    "relax.exp": np.exp,
    "relax.erf": math.erf,
    "relax.negative": np.negative,
    "relax.abs": np.abs,
    "relax.sqrt": np.sqrt,
    "relax.rsqrt": lambda a: 1 / np.sqrt(a),
    "relax.log": np.log,
    "relax.square": np.square,
}
_BINARY = {
    "relax.add": np.add,
    "relax.subtract": np.subtract,
    "relax.multiply": np.multiply,
    "relax.divide": np.divide,
    "relax.maximum": np.maximum,
    "relax.minimum": np.minimum,
    "relax.power": np.power,
}
# Per channel over the map's spatial axes: a constant channel stays that constant.
_SPATIAL_REDUCTIONS = {"relax.mean", "relax.max", "relax.min"}
_POOLS = {"relax.nn.max_pool2d", "relax.nn.adaptive_avg_pool2d", "relax.image.resize2d"}


def padded_channels(channels: int, block: int) -> int:
    """``channels`` rounded up to whole blocks where that pays, else ``channels``."""
    padded = -(-channels // block) * block
    return padded if padded <= MAX_PADDED_SHARE * channels else channels


def _finite(value) -> float | None:
    with np.errstate(all="ignore"):
        value = np.float32(value)
    return float(value) if np.isfinite(value) else None


def _scalar_constant(expr: relax.Expr) -> float | None:
    if isinstance(expr, tvm.ir.GenericConst) and expr.value.numpy().size == 1:
        return float(expr.value.numpy().reshape(()))
    return None


@dataclass(frozen=True)
class _Padded:
    """What is known of a padded NCHW map: its real channel count and its pad channels' value."""

    channels: int
    value: float


class _ChannelPadder:
    """One walk over ``main``'s dataflow block, rebuilding it with padded channels."""

    def __init__(self, block: int) -> None:
        self.block = block
        self.builder = relax.BlockBuilder()
        self.vars: dict[relax.Var, relax.Expr] = {}
        self.padded: dict[relax.Var, _Padded] = {}

    def arg(self, expr: relax.Expr) -> relax.Expr:
        """``expr`` over the rebuilt vars (an op's tuple argument, concat's, field by field)."""
        if isinstance(expr, relax.Tuple):
            return relax.Tuple([self.arg(field) for field in expr.fields])
        return self.vars.get(expr, expr) if isinstance(expr, relax.Var) else expr

    def pad_axis(self, expr: relax.Expr, axis: int, to: int) -> relax.Var:
        """``expr`` with zeros after its ``axis`` up to ``to``."""
        shape = static_shape(expr)
        widths = [0] * (2 * len(shape))
        widths[2 * axis + 1] = to - shape[axis]
        return self.builder.emit(relax.op.nn.pad(expr, widths))

    def holds_padded(self, expr: relax.Expr) -> bool:
        if isinstance(expr, relax.Tuple):
            return any(self.holds_padded(field) for field in expr.fields)
        return isinstance(expr, relax.Var) and expr in self.padded

    def sliced(self, expr: relax.Expr) -> relax.Expr:
        """``expr`` with its real channels only."""
        if isinstance(expr, relax.Tuple):
            return relax.Tuple([self.sliced(field) for field in expr.fields])
        info = self.padded.get(expr) if isinstance(expr, relax.Var) else None
        if info is None:
            return expr
        return self.builder.emit(relax.op.strided_slice(expr, [1], [0], [info.channels]))

    def emit(self, value: relax.Expr, info: _Padded | None, name: str) -> relax.Var:
        var = self.builder.emit(value, name_hint=name)
        if info is not None:
            self.padded[var] = info
        return var

    def rewrite(self, value: relax.Expr) -> tuple[relax.Expr, _Padded | None]:
        """``value`` over the rebuilt vars, and what is known of its padding (``None``: not padded)."""
        if isinstance(value, relax.Var):
            new = self.arg(value)
            return new, self.padded.get(new)
        if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op):
            return self._everything_sliced(value), None
        args = [self.arg(a) for a in value.args]
        name = value.op.name
        if name == "relax.nn.conv2d":
            return self._conv(value, args)
        if not any(self.holds_padded(a) for a in args):
            return relax.Call(value.op, args, value.attrs, value.ty_args), None
        carried = self._channelwise(value, args)
        if carried is not None:
            return carried
        return relax.Call(value.op, [self.sliced(a) for a in args], value.attrs, value.ty_args), None

    def _everything_sliced(self, value: relax.Expr) -> relax.Expr:
        if isinstance(value, relax.Tuple):
            return self.sliced(self.arg(value))
        if isinstance(value, relax.TupleGetItem):
            return relax.TupleGetItem(self.arg(value.tuple_value), value.index)
        if isinstance(value, relax.Call):
            return relax.Call(value.op, [self.sliced(self.arg(a)) for a in value.args], value.attrs, value.ty_args)
        return value

    def _conv(self, call: relax.Call, args: list) -> tuple[relax.Expr, _Padded | None]:
        data, weight = args
        attrs = call.attrs
        data_shape, weight_shape = static_shape(data), static_shape(weight)
        plain = (attrs.data_layout, attrs.kernel_layout, attrs.out_layout) == ("NCHW", "OIHW", "NCHW")
        if not plain or data_shape is None or weight_shape is None or call.ty.dtype != "float32":
            return relax.Call(call.op, [self.sliced(data), weight], attrs, call.ty_args), None
        info = self.padded.get(data) if isinstance(data, relax.Var) else None
        groups = int(attrs.groups)
        out_channels, out_info = weight_shape[0], None
        if groups == 1:
            if info is not None:
                weight = self.pad_axis(weight, 1, data_shape[1])
            padded = padded_channels(out_channels, self.block)
            if padded != out_channels and (data_shape[1] % self.block == 0 or data_shape[1] < self.block):
                weight, out_info = self.pad_axis(weight, 0, padded), _Padded(out_channels, 0.0)
        elif info is not None and weight_shape[1] == 1 and out_channels == info.channels == groups:
            # Depthwise: the pad channels are convolved by zero filters of their own.
            groups, weight, out_info = data_shape[1], self.pad_axis(weight, 0, data_shape[1]), _Padded(groups, 0.0)
        else:
            data = self.sliced(data)
            if self.widens_groups(call, static_shape(data), weight_shape):
                weight, groups = self.block_diagonal(weight, weight_shape), weight_shape[0] // self.block
        conv = relax.op.nn.conv2d(
            data, weight, attrs.strides, attrs.padding, attrs.dilation, groups,
            attrs.data_layout, attrs.kernel_layout, attrs.out_layout, attrs.out_dtype or None,
        )  # fmt: skip
        return conv, out_info

    def widens_groups(self, call: relax.Call, data_shape: list[int] | None, weight_shape: list[int]) -> bool:
        """Whether a grouped conv runs with groups a block wide: a strided one whose groups are narrower
        than a block and tile it. Left NCHW, its vectors read every other column: ResNeXt-50's 3x3
        stride-2 conv of 8-channel groups ran 4.9x ONNX Runtime's time on 16-channel blocks (6.1 ms
        against 1.2; Intel Xeon, AVX-512), where 8-channel blocks on AVX2 take it as it is."""
        groups, width = int(call.attrs.groups), weight_shape[1]
        if data_shape is None or groups == 1 or width == 1 or max(int(s) for s in call.attrs.strides) == 1:
            return False
        square = weight_shape[0] == data_shape[1] == groups * width
        return square and width < self.block and self.block % width == 0 and weight_shape[0] % self.block == 0

    def block_diagonal(self, weight: relax.Expr, weight_shape: list[int]) -> relax.Var:
        """A grouped conv's (O, w, kh, kw) weight as (O, block, kh, kw): each output channel's filter at its
        group's place within the block, zeros elsewhere (block / w times the multiply-adds)."""
        channels, width = weight_shape[0], weight_shape[1]
        tiled = relax.op.tile(weight, [1, self.block // width, 1, 1])  # tiled[o, i] = weight[o, i % width]
        within = np.arange(self.block) // width
        mask = (within[None, :] == (np.arange(channels) % self.block // width)[:, None]).astype(np.float32)
        return self.builder.emit(relax.op.multiply(tiled, relax.const(mask.reshape(channels, self.block, 1, 1))))

    def _channelwise(self, call: relax.Call, args: list) -> tuple[relax.Expr, _Padded] | None:
        """``call`` carried on the padded map, where it works channel by channel and keeps the pad
        channels finite; else ``None``."""
        name = call.op.name
        if any(isinstance(a, relax.Tuple) for a in args):
            return None
        infos = [self.padded.get(a) if isinstance(a, relax.Var) else None for a in args]
        lead = next(info for info in infos if info is not None)
        if name in _UNARY and len(args) == 1:
            with np.errstate(all="ignore"):
                value = _finite(_UNARY[name](np.float32(lead.value)))
            if value is None:
                return None
            return relax.Call(call.op, args, call.attrs, call.ty_args), _Padded(lead.channels, value)
        if name in _BINARY and len(args) == 2:
            return self._binary(call, args, infos, lead)
        shape = static_shape(call)
        if name in _SPATIAL_REDUCTIONS and shape is not None and len(shape) == 4:
            axes = sorted(int(a) % 4 for a in call.attrs.axis) if call.attrs.axis is not None else []
            if axes and 1 not in axes and bool(call.attrs.keepdims):
                return relax.Call(call.op, args, call.attrs, call.ty_args), lead
        if name in _POOLS and getattr(call.attrs, "layout", "NCHW") == "NCHW":
            return relax.Call(call.op, args, call.attrs, call.ty_args), lead
        return None

    def _binary(self, call: relax.Call, args: list, infos: list, lead: _Padded):
        padded_to = next(static_shape(a)[1] for a, info in zip(args, infos, strict=True) if info is not None)
        values, operands = [], []
        for arg, info in zip(args, infos, strict=True):
            shape = static_shape(arg)
            if info is not None:
                values.append(info.value)
                operands.append(arg)
                continue
            if shape is None or len(shape) > 4:  # a wider operand would move the channel axis
                return None
            channel = len(shape) - 3  # the channel axis, broadcast against NCHW from the right
            if channel < 0 or shape[channel] == 1:
                value = _scalar_constant(arg)
                if value is None:  # varies along the channels' pad: not one known value
                    return None
                values.append(value)
                operands.append(arg)
            elif shape[channel] == lead.channels and math.prod(shape) == shape[channel]:
                # A bias or a gate, one value a channel: padded with zeros (a whole map would be a copy).
                values.append(0.0)
                operands.append(self.pad_axis(arg, channel, padded_to))
            else:
                return None
        if len({info.channels for info in infos if info is not None}) != 1:
            return None
        with np.errstate(all="ignore"):
            value = _finite(_BINARY[call.op.name](np.float32(values[0]), np.float32(values[1])))
        if value is None:
            return None
        return relax.Call(call.op, operands, call.attrs, call.ty_args), _Padded(lead.channels, value)


def pad_channels_to_blocks(mod: tvm.ir.IRModule, block: int) -> tvm.ir.IRModule:
    """``mod`` with its convs' channels padded to whole ``block``s (see the module's docstring). A
    ``main`` that is not one dataflow block is left as it is."""
    func = mod["main"] if "main" in [g.name_hint for g in mod.get_global_vars()] else None
    body = getattr(func, "body", None)
    blocks = body.blocks if isinstance(body, relax.SeqExpr) else []
    if len(blocks) != 1 or not isinstance(blocks[0], relax.DataflowBlock):
        return mod
    if not all(isinstance(binding, relax.VarBinding) for binding in blocks[0].bindings):
        return mod
    padder = _ChannelPadder(block)
    builder = padder.builder
    with builder.function("main", list(func.params), attrs=dict(func.attrs), pure=func.is_pure):
        with builder.dataflow():
            for binding in blocks[0].bindings:
                value, info = padder.rewrite(binding.value)
                if not isinstance(binding.var, relax.DataflowVar):
                    value = padder.sliced(padder.emit(value, info, binding.var.name)) if info else value
                    padder.vars[binding.var] = builder.emit_output(value, name_hint=binding.var.name)
                else:
                    padder.vars[binding.var] = padder.emit(value, info, binding.var.name)
        result = body.body
        fields = result.fields if isinstance(result, relax.Tuple) else None
        builder.emit_func_output(relax.Tuple([padder.arg(f) for f in fields]) if fields else padder.arg(result))
    padded = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
    padded["main"] = builder.get()["main"]
    return padded
