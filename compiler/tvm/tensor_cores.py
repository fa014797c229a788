"""CUDA tensor cores for a model whose precision contract allows ``f16``: its float32 matmuls computed with
float16 operands and float32 sums, which dlight's GPU ``Matmul`` rule tensorizes into ``wmma`` 16x16x16
fragments (``mma.sync`` on the tensor cores; sm_70 and newer).

``x @ W`` becomes ``matmul(astype(x, float16), astype(W, float16), out_dtype=float32)`` where all of the
product's dims are static and larger than 64: dlight tensorizes nothing smaller, and a small product in
float16 would lose precision for no speed. Whatever follows the product (bias, activation, residual) stays
float32, as do the convolutions (dlight has no tensor-core rule for them), reductions and everything else.
The kernel is verified within the contract's budget like any reduced precision.

Asked for with :data:`compiler.tvm.bf16.PRECISION_ATTR` ``"f16"`` on the module
(``compile_relax(..., precision="f16")``). Runs in the compile child only (imports TVM).
"""

from __future__ import annotations

import tvm
from tvm import relax

from .bf16 import PRECISION_ATTR
from .main_rewrite import op_name, rewrite_main
from .panels import _static
from .tensor_intrinsics import register_tensor_intrinsics

TENSOR_CORE_MIN_DIM = 64
"""dlight's GPU Matmul tensorizes a product only where every static dim (but the batch) is above this."""


def wants_tensor_cores(mod: tvm.ir.IRModule) -> bool:
    """Whether the compile of ``mod`` may use float16 tensor cores (:data:`PRECISION_ATTR` ``"f16"``)."""
    return bool(mod.attrs) and PRECISION_ATTR in mod.attrs and str(mod.attrs[PRECISION_ATTR]) == "f16"


def _product_dims(x: list[int], w: list[int]) -> tuple[int, int, int] | None:
    """(rows, columns, depth) of ``x @ w`` where it is a plain or batched product of static operands."""
    if len(x) < 2 or len(w) < 2 or x[-1] != w[-2]:
        return None
    rows = 1
    for dim in x[:-1]:
        rows *= dim
    return (rows if len(w) == 2 else x[-2]), w[-1], x[-1]


@relax.expr_functor.mutator
class _HalfMatmuls(relax.PyExprMutator):
    def __init__(self, mod: tvm.ir.IRModule) -> None:
        super().__init__(mod)
        self.rewritten = 0

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if op_name(call) != "relax.matmul" or call.ty.dtype != "float32":
            return call
        x, w = call.args
        shapes = _static(x), _static(w)
        if None in shapes or x.ty.dtype != "float32" or w.ty.dtype != "float32":
            return call
        dims = _product_dims(*shapes)
        if dims is None or min(dims) <= TENSOR_CORE_MIN_DIM:
            return call
        self.rewritten += 1
        half = [relax.op.astype(operand, "float16") for operand in (x, w)]
        return relax.op.matmul(*half, out_dtype="float32")


def half_matmuls(mod: tvm.ir.IRModule) -> tuple[tvm.ir.IRModule, int]:
    """``mod`` with every float32 matmul whose dims are static and above :data:`TENSOR_CORE_MIN_DIM` computed
    with float16 operands and float32 sums, and how many it rewrote."""
    return rewrite_main(mod, lambda _main: _HalfMatmuls(mod))


@tvm.transform.module_pass(opt_level=0, name="jitserve_tensor_cores")
def tensor_core_pass(mod: tvm.ir.IRModule, _ctx: tvm.transform.PassContext) -> tvm.ir.IRModule:
    if not wants_tensor_cores(mod):
        return mod
    mod, rewritten = half_matmuls(mod)
    if rewritten:  # dlight's tensor-core rule names CUDA's wmma intrinsics: registered now, quickly
        register_tensor_intrinsics({"kind": "cuda"})
    return mod
