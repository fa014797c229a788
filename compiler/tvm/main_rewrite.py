"""One rewrite of a module's ``main`` by a Relax mutator that counts what it rewrote (the integer, bf16 and
quantized-conv rewrites of the layout stage).

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
