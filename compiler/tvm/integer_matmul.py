"""Integer matmuls kept in integers: a quantized model's ``MatMulInteger`` computed on the CPU's int8
unit instead of as an int32 matmul.

TVM's importer widens both operands of ``MatMulInteger`` to int32 and subtracts their zero points
before an int32 matmul: exact, but each product is a 32-bit multiply (``vpmulld``), slower than fp32.
Here such a matmul by a weight ``W`` of the model (int8 or uint8, ``K x N``, with zero point ``zw``, per
tensor or per column) becomes

    C[m, n] = sum_k A[m, k] * W'[k, n] - za * colsum(W')[n],    W' = W - zw (int16, exact)

with ``A`` the uint8/int8 activation and ``za`` its zero point. ``W'`` is packed once into panels of 8
columns by groups of ``k``: the layouts of :mod:`compiler.tvm.intrinsics`' AVX2 dot products, which
:class:`compiler.tvm.schedules.integer.IntegerContraction` tensorizes the ``integer_matmul`` block into.

- ``(N/8, K/4, 8, 4)`` int8, where ``A`` is uint8 and ``W'`` is int8: ``vpmaddubsw`` on AVX2, ``vpdpbusd``
  on VNNI (exact: it sums into int32). An ONNX ``MatMulInteger`` takes it on any int8 weight, as ONNX
  Runtime's own kernels do: on AVX2 their ``vpmaddubsw`` saturates a pair of k whose products pass int16 at
  the operands' extremes, and so does this one, pairing the same k (``quantize_dynamic``'s 8-bit weights
  answer as ONNX Runtime does, to the bit). A QDQ matmul spelled as one (:func:`quantized_matmuls`) takes
  it only where it is exact: on VNNI, or where every pair of ``k`` keeps ``BYTE_PAIR_BOUND``
  (:func:`compiler.models.quantized.byte_pairs_fit`: 7-bit weights always do).
- ``(N/8, K/2, 8, 2)`` int16 otherwise, ``A`` widened to int16 once per request: ``vpmaddwd``, which
  multiplies int16 pairs into int32 and never saturates.

A quantized model's int8 weights are kernel parameters (:mod:`compiler.models.weights`), their values
known to the compile (:data:`compiler.tvm.main_rewrite.INTEGER_WEIGHTS_ATTR`): the panels are computed
from the parameter by the weight transform, held once per model version however many buckets use them,
and the column sums (``N`` int32s, from the values the graph digest holds) are constants of the kernel. A
constant int8 weight (a graph the compile was handed whole) is packed here instead.

Runs in the compile child only (imports TVM).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te, tirx

from ..models.quantized import bytes_sum_exactly
from .main_rewrite import bound_value, int8_dequantize, integer_value, integer_weights, op_name, rewrite_main
from .panels import _static

_CONSTANT_FORMS = ("relax.astype", "relax.expand_dims", "relax.reshape")
PANEL_LANES = 8
"""int32 outputs per panel: one AVX2 vector."""
BYTE_GROUP = 4
"""k per int32 lane in a byte panel: two pairs, each summed by vpmaddubsw, then both by vpmaddwd."""
INTEGER_MATMUL = "integer_matmul"
"""The product block's name, which the schedule rule looks for."""


def panel_product(x: te.Tensor, panels: te.Tensor, *, widen, name: str) -> te.Tensor:
    """``x`` (``..., M, K``) by ``(N/l, K/g, l, g)`` panels: ``(..., M, N/l, l)`` sums of ``g`` products a step,
    each operand in the type ``widen`` takes it to (int32 here, float32 for bf16: :mod:`compiler.tvm.bf16`)."""
    *lead, rows, _ = (int(d) for d in x.shape)
    count, steps, lanes, pair = (int(d) for d in panels.shape)
    step = te.reduce_axis((0, steps), name="k_pair")
    within = te.reduce_axis((0, pair), name="k_within")
    return te.compute(
        (*lead, rows, count, lanes),
        lambda *i: te.sum(
            widen(x[(*i[:-2], step * pair + within)]) * widen(panels[i[-2], step, i[-1], within]),
            axis=[step, within],
        ),
        name=name,
    )


def _integer_panel_matmul(x: te.Tensor, panels: te.Tensor, column_sums: te.Tensor, x_zero: te.Tensor, columns: int):
    *lead, rows, _ = (int(d) for d in x.shape)
    lanes = int(panels.shape[2])
    product = panel_product(x, panels, widen=lambda v: v.astype("int32"), name=INTEGER_MATMUL)
    return te.compute(
        (*lead, rows, columns),
        lambda *i: product[(*i[:-1], i[-1] // lanes, i[-1] % lanes)] - x_zero() * column_sums[i[-1]],
        name="columns",
    )


def _widened(mutator: relax.PyExprMutator, expr: relax.Expr) -> tuple[relax.Expr, relax.Expr | None] | None:
    """``expr`` as (the int8/uint8 tensor it widened to int32, the zero point subtracted or None):
    ``astype(q, "int32") - zero`` or ``astype(q, "int32")``, through the bindings ``mutator`` has seen."""
    zero = None
    value = bound_value(mutator, expr)
    if op_name(value) == "relax.subtract":
        expr, zero = value.args
        value = bound_value(mutator, expr)
    if op_name(value) != "relax.astype":
        return None
    source = value.args[0]
    if source.ty.dtype not in ("int8", "uint8") or value.ty.dtype != "int32":
        return None
    return source, zero


def _integer_panels(weight: te.Tensor, zero: te.Tensor, group: int, dtype: str) -> te.Tensor:
    """:func:`pack_panels` of ``weight - zero`` (``zero`` per column) in ``dtype``, computed from a parameter."""
    depth, columns = (int(d) for d in weight.shape)
    count = -(-columns // PANEL_LANES)

    def element(p, k, lane, within):
        column = tirx.min(p * PANEL_LANES + lane, columns - 1)
        exact = weight[k * group + within, column].astype("int16") - zero[column].astype("int16")
        return tirx.if_then_else(p * PANEL_LANES + lane < columns, exact.astype(dtype), tirx.const(0, dtype))

    return te.compute((count, depth // group, PANEL_LANES, group), element, name="integer_panels")


@relax.expr_functor.mutator
class _IntegerMatmuls(relax.PyExprMutator):
    def __init__(self, mod: tvm.ir.IRModule, exact_bytes: bool) -> None:
        super().__init__(mod)
        self.exact_bytes = exact_bytes
        self.weights = integer_weights(mod)
        self.rewritten = 0

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if op_name(call) != "relax.matmul" or call.ty.dtype != "int32":
            return call
        activation, weight = (_widened(self, arg) for arg in call.args)
        value = None if weight is None else integer_value(weight[0], self.weights)
        if activation is None or value is None:
            return call  # a weight computed per request
        (x, x_zero), (w, w_zero) = activation, weight
        data, shape = _static(x), _static(w)
        if data is None or shape is None or len(shape) != 2 or len(data) < 2 or shape[0] % 2:
            return call
        if x_zero is not None and _static(x_zero) != []:
            return call  # a per-row activation zero point: not MatMulInteger's per-tensor one
        zero_value = np.zeros((), np.int16) if w_zero is None else self._constant(w_zero)
        if zero_value is None or list(zero_value.shape) not in ([], [shape[1]], [1, shape[1]]):
            return call
        depth = shape[0]
        exact = value.astype(np.int16) - zero_value.astype(np.int16)
        sums = relax.const(exact.astype(np.int32).sum(axis=0, dtype=np.int32))
        in_bytes = x.ty.dtype == "uint8" and depth % BYTE_GROUP == 0
        in_bytes = in_bytes and bytes_sum_exactly(exact, exact_sums=self.exact_bytes)
        group, dtype = (BYTE_GROUP, "int8") if in_bytes else (2, "int16")
        if isinstance(w, tvm.ir.GenericConst):
            panels = relax.const(pack_panels(exact.astype(dtype), group))
        else:  # a parameter: packed by the weight transform, held once per model version
            zero = relax.const(np.broadcast_to(zero_value.reshape(-1), (shape[1],)).astype(np.int16))
            panels = self.builder_.emit(
                self.builder_.call_te(_integer_panels, w, zero, group, dtype, primfunc_name_hint="integer_panels")
            )
        zero = relax.const(0, "int32") if x_zero is None else x_zero
        self.rewritten += 1
        if dtype == "int16":  # widened once per request, not per row and pair of k in the product
            x = self.builder_.emit(relax.op.astype(x, "int16"))
        return self.builder_.call_te(
            _integer_panel_matmul, x, panels, sums, zero, shape[1], primfunc_name_hint=INTEGER_MATMUL
        )

    def _constant(self, expr: relax.Expr) -> np.ndarray | None:
        """``expr``'s value where it is a constant, or a constant cast or reshaped (the importer's widened zero
        point, a per-column one as a row)."""
        value = bound_value(self, expr)
        if op_name(value) in _CONSTANT_FORMS:
            inner = self._constant(value.args[0])
            shape = _static(value)
            if inner is None or shape is None:
                return None
            return inner.astype(str(value.ty.dtype)).reshape(shape)
        return value.value.numpy() if isinstance(value, tvm.ir.GenericConst) else None


def _per_tensor(expr: relax.Expr) -> bool:
    return _static(expr) in ([], [1])


@relax.expr_functor.mutator
class _QuantizedMatmuls(relax.PyExprMutator):
    """A QDQ graph's ``matmul(dequantize(q, sx, zx), dequantize(W, sw, zw))`` spelled as ``MatMulInteger``'s
    imported form, ``matmul(astype(u, int32) - zu, astype(W, int32) - zw)`` in int32, times ``sx * sw``:
    which :class:`_IntegerMatmuls` then computes on panels. An int8 ``q`` enters as the uint8 ``u = q + 128``
    with ``zu = zx + 128`` (the same differences), so that bytes can take it where they sum exactly."""

    def __init__(self, mod: tvm.ir.IRModule) -> None:
        super().__init__(mod)
        self.weights = integer_weights(mod)
        self.rewritten = 0

    # A per-tensor scale or zero point is a constant in every QDQ graph here: computed in numpy, not left to
    # FoldConstant, which evaluated each of BERT-base's 144 as a kernel of its own (16.8 s of a 63 s compile).
    def _scalar(self, expr: relax.Expr) -> relax.Expr:
        value = bound_value(self, expr)
        if isinstance(value, tvm.ir.GenericConst):
            return relax.const(value.value.numpy().reshape(()))
        return self.builder_.emit(relax.op.reshape(expr, []))

    def _shifted_zero(self, expr: relax.Expr, shift: int) -> relax.Expr:
        value = bound_value(self, expr)
        if isinstance(value, tvm.ir.GenericConst):
            return relax.const(int(value.value.numpy().reshape(())) + shift, "int32")
        shifted = relax.op.add(relax.op.astype(relax.op.reshape(expr, []), "int32"), relax.const(shift, "int32"))
        return self.builder_.emit(shifted)

    def _weight_zero(self, expr: relax.Expr, columns: int) -> np.ndarray | None:
        value = bound_value(self, expr)
        if not isinstance(value, tvm.ir.GenericConst):
            return None
        zero = value.value.numpy().astype(np.int32)
        return zero.reshape(()) if zero.size == 1 else (zero if zero.shape == (columns,) else None)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if op_name(call) != "relax.matmul" or call.ty.dtype != "float32":
            return call
        activation, weight = (int8_dequantize(self, arg) for arg in call.args)
        if activation is None or weight is None or integer_value(weight.args[0], self.weights) is None:
            return call
        shape = _static(weight.args[0])
        if shape is None or len(shape) != 2 or shape[0] % 2 or _static(activation.args[0]) is None:
            return call
        (x_scale, x_zero), (w_scale, w_zero) = activation.args[1:], weight.args[1:]
        per_column = _static(w_scale) == [shape[1]] and int(weight.attrs.axis) in (1, -1)
        if not (_per_tensor(x_scale) and _per_tensor(x_zero) and (_per_tensor(w_scale) or per_column)):
            return call
        zero = self._weight_zero(w_zero, shape[1])
        if zero is None:
            return call
        emit, quantized = self.builder_.emit, activation.args[0]
        shift = 128 if quantized.ty.dtype == "int8" else 0
        unsigned = emit(relax.op.astype(relax.op.add(relax.op.astype(quantized, "int16"), relax.const(shift, "int16")),
                                        "uint8"))  # fmt: skip
        x_zero = self._shifted_zero(x_zero, shift)
        x = emit(relax.op.subtract(emit(relax.op.astype(unsigned, "int32")), x_zero))
        w = emit(relax.op.subtract(emit(relax.op.astype(weight.args[0], "int32")), relax.const(zero, "int32")))
        sums = emit(relax.op.matmul(x, w, out_dtype="int32"))
        scale = emit(relax.op.multiply(self._scalar(x_scale), w_scale))
        self.rewritten += 1
        return self.builder_.normalize(relax.op.multiply(relax.op.astype(sums, "float32"), scale))


def quantized_matmuls(mod: tvm.ir.IRModule) -> tuple[tvm.ir.IRModule, int]:
    """``mod`` with every float matmul of a QDQ graph's dequantized activation (per tensor) by a dequantized
    2-D int8 or uint8 weight of the model of even depth (per tensor, or per column) spelled as an integer one
    (:class:`_QuantizedMatmuls`), and how many it rewrote. Run before :func:`integer_matmuls`."""
    return rewrite_main(mod, lambda _main: _QuantizedMatmuls(mod))


@relax.expr_functor.mutator
class _GatheredFirst(relax.PyExprMutator):
    """``take(dequantize(W, s, z), i)`` (a statically quantized embedding) as ``dequantize(take(W, i), s, z)``:
    the same value element for element, where dequantizing first made the weight transform hold the whole
    table in float (BERT-base's: 94 MB, past the int8 weights it came from)."""

    def __init__(self, mod: tvm.ir.IRModule) -> None:
        super().__init__(mod)
        self.rewritten = 0

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if op_name(call) == "relax.shape_of" and (shape := _static(call.args[0])) is not None:
            # The importer's bound check reads the table's shape: a shape known here keeps no float table alive.
            return relax.ShapeExpr(shape)
        if op_name(call) != "relax.take":
            return call
        table = int8_dequantize(self, call.args[0])
        if table is None or not (_per_tensor(table.args[1]) and _per_tensor(table.args[2])):
            return call
        rows = self.builder_.emit(relax.op.take(table.args[0], call.args[1], call.attrs.axis, call.attrs.mode))
        self.rewritten += 1
        return relax.op.dequantize(rows, table.args[1], table.args[2], out_dtype=str(table.attrs.out_dtype))


def quantized_gathers(mod: tvm.ir.IRModule) -> tuple[tvm.ir.IRModule, int]:
    """``mod`` with every lookup in a dequantized int8 table (per tensor) made before the dequantize
    (:class:`_GatheredFirst`), and how many it moved."""
    return rewrite_main(mod, lambda _main: _GatheredFirst(mod), drop_unused=True)


def pack_panels(exact: np.ndarray, group: int) -> np.ndarray:
    """A ``K x N`` weight (K a multiple of ``group``) as ``(N/8, K/group, 8, group)`` panels, zeros past N.
    Computed here for a constant: folded by TVM, each of BERT-base's 72 took a compile of its own
    (fold_constants: 0.8 -> 4.4 s on a one-layer encoder)."""
    depth, columns = exact.shape
    count = -(-columns // PANEL_LANES)
    padded = np.zeros((depth, count * PANEL_LANES), exact.dtype)
    padded[:, :columns] = exact
    return np.ascontiguousarray(padded.reshape(depth // group, group, count, PANEL_LANES).transpose(2, 0, 3, 1))


def integer_matmuls(mod: tvm.ir.IRModule, *, exact_bytes: bool = False) -> tuple[tvm.ir.IRModule, int]:
    """``mod`` with every widened int8 x int8 matmul by a weight of the model computed on packed panels (see
    the module's docstring), and how many it rewrote; ``exact_bytes``: the target sums bytes exactly (VNNI)."""
    return rewrite_main(mod, lambda _main: _IntegerMatmuls(mod, exact_bytes))
