"""bf16 kernels: a float32 matmul or channel-blocked conv by a weight computed with bf16 operands and
float32 sums, on AVX512-BF16's ``vdpbf16ps`` (:mod:`compiler.tvm.intrinsics`), for a model whose precision
contract allows ``bf16``.

``x @ W`` (``W`` a weight or a constant, ``K x N``, ``K`` even) becomes three functions:

- the weight's panels, ``(N/16, K/2, 16, 2)`` bf16 (stored as uint16: TVM legalizes bf16 storage to it),
  rounded to nearest even: computed from the weight alone, so ``LiftTransformParams`` lifts them into the
  weight transform, held once per model version as the fp32 panels are;
- the activation in bf16, converted once per request at the contraction's input, its rows zero-padded to
  whole register tiles (:data:`ROW_MULTIPLE`);
- the ``bf16_matmul`` product, each lane summing pairs of bf16 products into float32, which
  :class:`compiler.tvm.schedules.integer.IntegerContraction` tensorizes into ``vdpbf16ps`` where the
  target has it (elsewhere another rule schedules the same sums, in float32 on the FMA units).

A conv blocked by the layout stage (NCHW{b}c, one group, whole blocks of channels: :func:`bf16_convs`)
is computed the same way on the integer conv's product (:func:`compiler.tvm.integer_conv.blocked_conv_product`):
its weight in ``(O/b, I/b, KH, KW, b/2, b, 2)`` bf16 panels, its map converted where it enters, and
:class:`compiler.tvm.schedules.integer.IntegerConvContraction` tensorizes it where ``b`` is 16 (AVX-512).

Whatever follows the product (bias, activation, residual) stays float32. The compile is asked for with
:data:`PRECISION_ATTR` on the module (``compile_relax(..., precision="bf16")``).

Runs in the compile child only (imports TVM).
"""

from __future__ import annotations

import tvm
from tvm import relax, te, tirx

from .integer_conv import blocked_conv_geometry, blocked_conv_product, blocked_conv_weight
from .integer_matmul import panel_product
from .main_rewrite import op_name, rewrite_main
from .panels import _static, weight_vars

PRECISION_ATTR = "jitserve_precision"
"""The module attribute naming the reduced precision a compile may use (``"bf16"``); absent: fp32."""
BF16_LANES = 16
"""float32 outputs per panel: one AVX-512 vector, ``vdpbf16ps``'s width."""
BF16_MATMUL = "bf16_matmul"
"""The product block's name, which the schedule rule looks for."""
BF16_CONV = "bf16_conv"
"""The conv product block's name."""
ROW_MULTIPLE = 4
"""A matmul's rows are computed in whole register tiles of this many (the rule's largest): a row count with
no such divisor (ViT's 197 tokens) is zero-padded up to one, not tiled a row at a time (1.5% more rows, where
one-row tiles read every weight panel once per row: ViT-B/16's bf16 products ran at 1.48x fp32 OpenVINO)."""


def bf16_bits(value: tirx.PrimExpr) -> tirx.PrimExpr:
    """A float32 ``value``'s nearest bf16 (ties to even), as the uint16 of its bits; a NaN stays a NaN."""
    bits = tirx.reinterpret("uint32", value)
    sixteen = tirx.const(16, "uint32")
    rounded = (bits + ((bits >> sixteen) & tirx.const(1, "uint32")) + tirx.const(0x7FFF, "uint32")) >> sixteen
    is_nan = (bits & tirx.const(0x7FFFFFFF, "uint32")) > tirx.const(0x7F800000, "uint32")
    quiet = (bits >> sixteen) | tirx.const(0x40, "uint32")
    return tirx.Select(is_nan, quiet, rounded).astype("uint16")


def _bf16_float(bits: tirx.PrimExpr) -> tirx.PrimExpr:
    return tirx.reinterpret("float32", bits.astype("uint32") << tirx.const(16, "uint32"))


def _weight_panels(weight: te.Tensor) -> te.Tensor:
    depth, columns = (int(d) for d in weight.shape)
    count = -(-columns // BF16_LANES)
    return te.compute(
        (count, depth // 2, BF16_LANES, 2),
        lambda p, k, lane, within: tirx.if_then_else(
            p * BF16_LANES + lane < columns,
            bf16_bits(weight[k * 2 + within, tirx.min(p * BF16_LANES + lane, columns - 1)]),
            tirx.const(0, "uint16"),
        ),
        name="bf16_panels",
    )


def _activation_bf16(x: te.Tensor) -> te.Tensor:
    return te.compute(x.shape, lambda *i: bf16_bits(x[i]), name="bf16_activation")


def padded_rows(rows: int) -> int:
    """The rows a product of ``rows`` computes: a whole number of :data:`ROW_MULTIPLE`-row register tiles."""
    return rows if rows < ROW_MULTIPLE else -(-rows // ROW_MULTIPLE) * ROW_MULTIPLE


def _rows_bf16(x: te.Tensor) -> te.Tensor:
    """A matmul's activation in bf16, its rows zero-padded to :func:`padded_rows`."""
    *lead, rows, depth = (int(d) for d in x.shape)
    padded = padded_rows(rows)
    if padded == rows:
        return _activation_bf16(x)
    return te.compute(
        (*lead, padded, depth),
        lambda *i: tirx.if_then_else(
            i[-2] < rows, bf16_bits(x[(*i[:-2], tirx.min(i[-2], rows - 1), i[-1])]), tirx.const(0, "uint16")
        ),
        name="bf16_activation",
    )


def _bf16_panel_matmul(x: te.Tensor, panels: te.Tensor, rows: int, columns: int) -> te.Tensor:
    """The product of the (row-padded) activation ``x`` by the panels, cut back to ``rows`` x ``columns``."""
    lead = [int(d) for d in x.shape[:-2]]
    lanes = int(panels.shape[2])
    product = panel_product(x, panels, widen=_bf16_float, name=BF16_MATMUL)
    return te.compute((*lead, rows, columns), lambda *i: product[(*i[:-1], i[-1] // lanes, i[-1] % lanes)],
                      name="columns")  # fmt: skip


class _FromWeights(relax.PyExprMutator):
    """A rewrite of products by the function's weights (or constants): what it rewrote, counted."""

    def __init__(self, mod: tvm.ir.IRModule, weights: set) -> None:
        super().__init__(mod)
        self.weights = weights
        self.rewritten = 0

    def from_weights(self, expr: relax.Expr) -> bool:
        return isinstance(expr, tvm.ir.GenericConst) or (isinstance(expr, relax.Var) and expr in self.weights)


@relax.expr_functor.mutator
class _Bf16Matmuls(_FromWeights):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if op_name(call) != "relax.matmul" or call.ty.dtype != "float32":
            return call
        x, w = call.args
        data, shape = _static(x), _static(w)
        if not self.from_weights(w) or x.ty.dtype != "float32" or data is None or shape is None:
            return call
        if len(shape) != 2 or len(data) < 2 or shape[0] % 2:
            return call
        if isinstance(x, relax.Call):  # a nested call (a flattening reshape): call_te takes a bound value
            x = self.builder_.emit(x)
        emit = self.builder_.emit
        panels = emit(self.builder_.call_te(_weight_panels, w, primfunc_name_hint="bf16_panels"))
        activation = emit(self.builder_.call_te(_rows_bf16, x, primfunc_name_hint="bf16_activation"))
        self.rewritten += 1
        return self.builder_.call_te(
            _bf16_panel_matmul, activation, panels, data[-2], shape[1], primfunc_name_hint=BF16_MATMUL
        )


def _conv_panels(weight: te.Tensor, block: int) -> te.Tensor:
    return te.compute(
        (weight.shape[0] // block, weight.shape[1] // block, weight.shape[2], weight.shape[3], block // 2, block, 2),
        lambda o, i, kh, kw, p, lane, within: bf16_bits(weight[o * block + lane, i * block + p * 2 + within, kh, kw]),
        name="bf16_conv_panels",
    )


def _bf16_conv(data: te.Tensor, panels: te.Tensor, strides, padding, dilation) -> te.Tensor:
    return blocked_conv_product(data, panels, strides, padding, dilation, widen=_bf16_float, name=BF16_CONV)


@relax.expr_functor.mutator
class _Bf16Convs(_FromWeights):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if op_name(call) != "relax.nn.conv2d" or call.ty.dtype != "float32":
            return call
        geometry = blocked_conv_geometry(call)
        weight = blocked_conv_weight(call.args[1], self.lookup_binding)
        shape = _static(weight)
        if (
            geometry is None
            or not self.from_weights(weight)
            or shape is None
            or len(shape) != 4
            or weight.ty.dtype != "float32"
        ):
            return call
        block = geometry[0]
        if block % 2 or shape[0] % block or shape[1] % block or call.args[0].ty.dtype != "float32":
            return call
        emit = self.builder_.emit
        panels = emit(self.builder_.call_te(_conv_panels, weight, block, primfunc_name_hint="bf16_conv_panels"))
        data = emit(self.builder_.call_te(_activation_bf16, call.args[0], primfunc_name_hint="bf16_activation"))
        self.rewritten += 1
        return self.builder_.call_te(_bf16_conv, data, panels, *geometry[1], primfunc_name_hint=BF16_CONV)


def bf16_convs(mod: tvm.ir.IRModule) -> tuple[tvm.ir.IRModule, int]:
    """``mod`` (channel-blocked) with every blocked float32 conv by a weight computed in bf16 with float32 sums
    (see the module's docstring), and how many it rewrote."""
    return rewrite_main(mod, lambda main: _Bf16Convs(mod, weight_vars(main)), drop_unused=True)


def wants_bf16(mod: tvm.ir.IRModule) -> bool:
    """Whether the compile of ``mod`` may use bf16 (:data:`PRECISION_ATTR`)."""
    return bool(mod.attrs) and PRECISION_ATTR in mod.attrs and str(mod.attrs[PRECISION_ATTR]) == "bf16"


def bf16_matmuls(mod: tvm.ir.IRModule) -> tuple[tvm.ir.IRModule, int]:
    """``mod`` with every float32 matmul by a weight (or constant) of even depth computed in bf16 with float32
    sums (see the module's docstring), and how many it rewrote."""
    return rewrite_main(mod, lambda main: _Bf16Matmuls(mod, weight_vars(main)))
