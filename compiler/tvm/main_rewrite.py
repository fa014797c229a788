"""One rewrite of a module's ``main`` by a Relax mutator that counts what it rewrote (the integer, bf16 and
quantized-conv rewrites of the layout stage), and what those rewrites read of the bindings alike.

Runs in the compile child only (imports TVM).
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax


def rewrite_main(
    mod: tvm.ir.IRModule, mutator_for: Callable[[relax.Function], relax.PyExprMutator], *, drop_unused: bool = False
) -> tuple[tvm.ir.IRModule, int]:
    """``mod`` with ``main`` rewritten by ``mutator_for(main)`` (whose ``rewritten`` counts its rewrites), and
    that count. Where it rewrote nothing, ``mod`` as it was: a rebuilt module loses what the dynamic tier's
    functions carry. ``drop_unused``: bindings the rewrite left unused (a blocked weight's transform) are
    dropped, not lifted into the weight transform."""
    if "main" not in [g_var.name_hint for g_var in mod.get_global_vars()]:
        return mod, 0
    main = mod["main"]
    mutator = mutator_for(main)
    rewritten = mutator.visit_expr(main)
    if not mutator.rewritten:
        return mod, 0
    if drop_unused:
        rewritten = relax.analysis.remove_all_unused(rewritten)
    mutator.builder_.update_func(mod.get_global_var("main"), rewritten)
    return mutator.builder_.get(), mutator.rewritten


def op_name(expr) -> str:
    """The name of the op ``expr`` calls (``relax.matmul``); empty for anything else."""
    return getattr(getattr(expr, "op", None), "name", "")


def bound_value(mutator: relax.PyExprMutator, expr: relax.Expr) -> relax.Expr:
    """What ``expr`` is bound to where it is a variable ``mutator`` has seen bound, else ``expr``."""
    return mutator.lookup_binding(expr) if isinstance(expr, relax.Var) else expr


def int8_dequantize(mutator: relax.PyExprMutator, expr: relax.Expr) -> relax.Call | None:
    """The ``dequantize`` of an int8 or uint8 tensor that ``expr`` is (or is bound to), else None."""
    value = bound_value(mutator, expr)
    if op_name(value) != "relax.dequantize" or value.args[0].ty.dtype not in ("int8", "uint8"):
        return None
    return value
