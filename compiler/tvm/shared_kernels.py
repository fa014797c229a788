"""Kernels built once and shared: a quantized graph's layers', and an elementwise op's across its calls.

A quantized graph's scalar scales and zero points become 0-d tensor operands, so its layers share kernels.

TVM's legalization turns each 0-d constant operand of ``quantize``, ``dequantize`` and the binary
arithmetic ops into an immediate of the kernel it builds. In a float model that is free: a scalar
(a layer norm's epsilon, attention's 1/sqrt(d)) is the same in every layer, so the layers' kernels still
come out equal and are built once. A QDQ graph has a scale and a zero point per tensor, different in
every layer, so no two layers' kernels were equal: QDQ BERT-base fused into 235 kernels and compiled in
57 s, 8x fp32's 7 s (AMD EPYC Zen 3, AVX2). Bound to a variable instead, the scalar reaches the kernel as a
0-d tensor argument that the kernel reads once, and the layers' kernels are one: 32 kernels, 15 s.
The values are unchanged and so are the answers: an immediate and a loaded value divide alike.

Only quantized modules are rewritten (those computing int8 or uint8 tensors); a float model keeps its
immediates, and so its kernels and the tuning records that match them.
Run just before legalization (after the layout stage's rewrites, which read the constants' values).

Runs in the compile child only (imports TVM).
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax

from .main_rewrite import any_call, op_name
from .shapes import static_shape

_SCALAR_OPERAND_OPS = frozenset(
    {"relax.quantize", "relax.dequantize", "relax.add", "relax.subtract", "relax.multiply", "relax.divide"}
)


def _is_scalar_constant(expr: relax.Expr) -> bool:
    return isinstance(expr, tvm.ir.GenericConst) and expr.ty.ndim == 0


def _quantized(function: relax.Function) -> bool:
    """Whether ``function`` computes an int8 or uint8 tensor: a quantize, or the elementwise form a blocked QDQ
    convnet's quantizes take (:func:`compiler.tvm.integer_conv.quantize_as_elementwise`). No float model does."""
    return any_call(function, lambda call: str(getattr(call.ty, "dtype", "")) in ("int8", "uint8"))


@relax.expr_functor.mutator
class _ScalarsBound(relax.PyExprMutator):
    def __init__(self, mod: tvm.ir.IRModule) -> None:
        super().__init__(mod)
        self.rewritten = 0

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if op_name(call) not in _SCALAR_OPERAND_OPS or not any(_is_scalar_constant(a) for a in call.args):
            return call
        self.rewritten += 1
        args = [self.builder_.emit(a) if _is_scalar_constant(a) else a for a in call.args]
        return relax.Call(call.op, args, call.attrs, call.ty_args, call.span)


def scalar_operands_bound(mod: tvm.ir.IRModule) -> tvm.ir.IRModule:
    """``mod`` with every 0-d constant operand of a quantize, dequantize, add, subtract, multiply or divide
    bound to a variable, in each Relax function (``main`` and its lifted weight transforms), where ``main`` is
    quantized (:func:`_quantized`); else ``mod`` as it is."""
    names = [g_var.name_hint for g_var in mod.get_global_vars()]
    if "main" not in names or not _quantized(mod["main"]):
        return mod
    mutator = _ScalarsBound(mod)
    for g_var, function in list(mod.functions.items()):
        if isinstance(function, relax.Function):
            mutator.builder_.update_func(g_var, mutator.visit_expr(function))
    return mutator.builder_.get() if mutator.rewritten else mod


@tvm.transform.module_pass(opt_level=0, name="jitserve_scalar_operands_bound")
def scalar_operands_pass(mod: tvm.ir.IRModule, _ctx: tvm.transform.PassContext) -> tvm.ir.IRModule:
    return scalar_operands_bound(mod)


# Elementwise ops whose TVM legalization depends on nothing but their attributes and operand types: a
# quantized graph calls them per layer by the hundred (QDQ BERT-base: 810 quantizes and dequantizes).
SHARED_ELEMENTWISE = (
    "relax.quantize", "relax.dequantize", "relax.astype", "relax.round",
    "relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.maximum", "relax.minimum",
)  # fmt: skip


_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


def _operand_types(call: relax.Call) -> tuple | None:
    """Each operand's static shape and dtype, where every operand is a variable of static shape; else None
    (a constant operand is read by value, and a symbolic shape asks for shape arguments)."""
    types = []
    for arg in call.args:
        shape = static_shape(arg)
        if not isinstance(arg, relax.Var) or shape is None:
            return None
        types.append((tuple(shape), str(arg.ty.dtype)))
    return tuple(types)


class BuiltOnce:
    """TVM's legalization of an op with each kernel built once per attributes and operand types, and called
    again for the next operands alike (``reused`` counts those calls); TVM builds a TE function and a kernel per
    call, and only then finds it equal to one it has. Valid within one run of ``LegalizeOps`` only: the
    kernels it names are that run's."""

    def __init__(self, op_name: str) -> None:
        self._legalize = tvm.ir.Op.get(op_name).get_attr("FLegalize")
        self._built: dict[tuple, list] = {}
        self.reused = 0

    def __call__(self, bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        types = _operand_types(call)
        if types is None:
            return self._legalize(bb, call)
        alike = self._built.setdefault(types, [])
        for attrs, kernel, output in alike:
            if tvm_ffi.structural_equal(attrs, call.attrs):
                self.reused += 1
                return relax.op.call_tir(kernel, relax.Tuple(list(call.args)), output)
        legalized = self._legalize(bb, call)
        operands = legalized.args[1].fields if getattr(legalized, "op", None) == _CALL_TIR else ()
        # Remembered only where the kernel takes the call's operands as they are, in their order.
        if (
            len(legalized.args) == 2
            and len(operands) == len(call.args)
            and all(a.same_as(b) for a, b in zip(operands, call.args, strict=True))
        ):
            alike.append((call.attrs, legalized.args[0], legalized.ty_args[0]))
        return legalized
