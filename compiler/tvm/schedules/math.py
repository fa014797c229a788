"""Vectorizable float32 math: erf, exp, sigmoid and tanh rewritten as polynomials
LLVM can vectorize (it has no vector erf and calls expf and tanhf once per lane).

NaN is tested on the bits, and clamps are min / max: both keep the expressions vectorized and
small (see ``_clamped`` and ``_nan_kept``)."""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx

from .base import root_blocks

_ERF_ALPHA = (
    -2.72614225801306e-10,
    2.77068142495902e-08,
    -2.10102402082508e-06,
    -5.69250639462346e-05,
    -7.34990630326855e-04,
    -2.95459980854025e-03,
    -1.60960333262415e-02,
)
_ERF_BETA = (
    -1.45660718464996e-05,
    -2.13374055278905e-04,
    -1.68282697438203e-03,
    -7.37332916720468e-03,
    -1.42647390514189e-02,
)
# Cephes' expf (TOPI's fast_exp) with a two-constant Cody-Waite reduction: within 1e-7
# relative. The result is scaled by 2^(n-1) * 2 so that n covers [-126, 128]: finite up to
# ln(FLT_MAX); below exp(-87) results flush to zero.
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)
_EXP_HI = 88.72283
_EXP_LO = -87.33654


# Eigen's rational logistic (MLAS's too): sigmoid(x) = x * P(x^2) / Q(x^2) + 1/2 on [-18, 18].
_LOGISTIC_ALPHA = (
    4.37031012579801e-11,
    1.15627324459942e-07,
    6.08574864600143e-05,
    8.51377133304701e-03,
    2.48287947061529e-01,
)
_LOGISTIC_BETA = (
    6.10247389755681e-13,
    5.76102136993427e-09,
    6.29106785017040e-06,
    1.70198817374094e-03,
    1.16817656904453e-01,
    9.93151921023180e-01,
)
_LOGISTIC_RANGE = 18.0
# Eigen's rational tanh (MLAS's too): tanh(x) = x * P(x^2) / Q(x^2) on [-9, 9].
_TANH_ALPHA = (
    -2.76076847742355e-16,
    2.00018790482477e-13,
    -8.60467152213735e-11,
    5.12229709037114e-08,
    1.48572235717979e-05,
    6.37261928875436e-04,
    4.89352455891786e-03,
)
_TANH_BETA = (1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03, 4.89352518554385e-03)
_TANH_RANGE = 9.0


def _f32(value: float):
    return tirx.const(value, "float32")


def _nan_kept(arg, result):
    """``result``, or ``arg`` where ``arg`` is NaN (which a min / max clamp turns into a bound).

    Tested on the bits, which vectorizes: ``tirx.isnan`` is extracted and tested lane by lane
    (a SiLU net ran at half speed), and the simplifier folds ``x != x`` to false.
    """
    magnitude = tirx.reinterpret("int32", arg) & tirx.const(0x7FFFFFFF, "int32")
    return tirx.Select(magnitude > tirx.const(0x7F800000, "int32"), arg, result)


def _polynomial(x, coefficients):
    result = _f32(coefficients[0])
    for coefficient in coefficients[1:]:
        result = result * x + _f32(coefficient)
    return result


def _clamped(arg, low: float, high: float):
    """min / max use ``arg`` once each. A clamp by comparisons used it twice at every level: an epilogue's
    polynomial held some 300 copies of its input and took 200 s to simplify. (A ``tirx.Let`` would bind it
    once, but MetaSchedule's task scheduler estimates each task's flops with a visitor that has no rule
    for ``Let``, and tuning failed.)"""
    return tirx.max(tirx.min(arg, _f32(high)), _f32(low))


def _rational(arg, alpha, beta, limit: float):
    """``x * P(x^2) / Q(x^2)`` of ``arg`` clamped to [-limit, limit]."""
    x = _clamped(arg, -limit, limit)
    x2 = x * x
    return x * _polynomial(x2, alpha) / _polynomial(x2, beta)


def _erf_float32(arg):
    return _nan_kept(arg, _rational(arg, _ERF_ALPHA, _ERF_BETA, 4.0))


def _exp_float32(arg):
    x = _clamped(arg, _EXP_LO, _EXP_HI)
    n = tirx.floor(x * _f32(1.44269504088896341) + _f32(0.5))
    f = x - n * _f32(0.693359375) - n * _f32(-2.12194440e-4)  # Cody-Waite: x - n ln 2 in two constants
    y = _polynomial(f, _EXP_POLY) * f * f + f + _f32(1.0)
    exponent = tirx.shift_left(tirx.Cast("int32", n + _f32(126.0)), tirx.const(23, "int32"))
    result = y * tirx.reinterpret("float32", exponent) * _f32(2.0)
    # Above the range, and for NaN: arg + inf is +inf, or NaN, as expf gives.
    return tirx.Select(arg <= _f32(_EXP_HI), result, arg + _f32(float("inf")))


def _sigmoid_float32(arg):
    """The logistic as ONNX Runtime computes it: a rational function, half the work of
    ``1 / (1 + exp(-x))`` (a SiLU net spent a quarter of its run in it). A rounding past 1 (or 0)
    is cut back."""
    logistic = _rational(arg, _LOGISTIC_ALPHA, _LOGISTIC_BETA, _LOGISTIC_RANGE) + _f32(0.5)
    return _nan_kept(arg, _clamped(logistic, 0.0, 1.0))


def _tanh_float32(arg):
    """tanh as ONNX Runtime computes it: LLVM calls libm's tanhf once per lane."""
    return _nan_kept(arg, _clamped(_rational(arg, _TANH_ALPHA, _TANH_BETA, _TANH_RANGE), -1.0, 1.0))


def _power_float32(base, exponent):
    """``base ** 2`` or ``** 3`` as products, else ``None``: LLVM calls libm's powf once per lane (a
    tanh-form GELU's x ** 3 over 1x128x3072 took 2.5 ms against ONNX Runtime's 0.5 for the whole GELU)."""
    if not isinstance(exponent, tirx.FloatImm) or float(exponent.value) not in (2.0, 3.0):
        return None
    return base * base if float(exponent.value) == 2.0 else base * base * base


def vectorizable_math_pass() -> tvm.transform.Pass:
    """Rewrite the float32 erf / exp / sigmoid / tanh blocks of every unscheduled TIR function."""

    @tvm.transform.module_pass(opt_level=0, name="jitserve_vectorizable_math")
    def _rewrite(mod: tvm.ir.IRModule, _ctx) -> tvm.ir.IRModule:
        rewritten = {}
        for global_var, func in mod.functions_items():
            if isinstance(func, tirx.PrimFunc) and not (func.attrs and func.attrs.get("tirx.is_scheduled")):
                sch = s_tir.Schedule(func)
                if _vectorizable_math(sch):
                    rewritten[global_var] = sch.mod["main"]
        if not rewritten:
            return mod
        mod = mod.clone()  # passes must not change their input
        for global_var, func in rewritten.items():
            mod.update_func(global_var, func)
        return mod

    return _rewrite


def _vectorizable_math(sch: s_tir.Schedule) -> bool:
    """Replace float32 ``B[i] = erf(A[i])`` / ``exp`` / ``sigmoid`` / ``tanh`` blocks by polynomials,
    and ``pow(A[i], 2 or 3)`` by products.

    LLVM has no vector erf (each element calls libm's erff: GELU's erf cost 4x its matmul)
    and turns a vector exp or tanh into one libm call per lane. The polynomials vectorize.
    Returns whether a block was rewritten.
    """
    changed = False
    rewrites = {
        tvm.ir.Op.get("tirx.erf"): _erf_float32,
        tvm.ir.Op.get("tirx.exp"): _exp_float32,
        tvm.ir.Op.get("tirx.sigmoid"): _sigmoid_float32,
        tvm.ir.Op.get("tirx.tanh"): _tanh_float32,
        tvm.ir.Op.get("tirx.pow"): _power_float32,
    }
    try:
        blocks = root_blocks(sch)
    except s_tir.ScheduleError:  # no root block: a CumSum of the dynamic tier is one opaque block
        return False
    for block_rv in blocks:
        block = sch.get(block_rv)
        store = block.body
        if not isinstance(store, tirx.BufferStore) or block.init is not None:
            continue
        call = store.value
        if not isinstance(call, tvm.ir.Call) or str(call.ty) != "float32":
            continue
        rewrite = next((f for op, f in rewrites.items() if call.op.same_as(op)), None)
        value = rewrite(*call.args) if rewrite is not None else None
        if value is None:
            continue
        body = tirx.BufferStore(store.buffer, value, store.indices)
        new_block = s_tir.SBlock(
            block.iter_vars,
            block.reads,
            block.writes,
            block.name_hint,
            body,
            None,
            block.alloc_buffers,
            block.match_buffers,
            block.annotations,
        )
        sch.state.replace(sch.get_sref(block_rv), new_block, {block: new_block})
        changed = True
    return changed
