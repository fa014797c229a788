"""One rewrite of a module's ``main`` by a Relax mutator that counts what it rewrote (the integer, bf16 and
quantized-conv rewrites of the layout stage), and what those rewrites read of the bindings alike.

Runs in the compile child only (imports TVM).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tvm
from tvm import relax

INTEGER_WEIGHTS_ATTR = "jitserve_integer_weights"
"""The module attribute holding the values of ``main``'s int8/uint8 weight parameters by name: what the
integer rewrites decide by (which weights sum exactly in bytes, their zero points) and fold into small
constants (column sums). The graph digest holds these values, so a kernel keyed by it may depend on them;
its large panels are computed from the parameter, in the weight transform."""


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


def any_call(function: relax.Function, predicate: Callable[[relax.Call], bool]) -> bool:
    """Whether some call in ``function`` satisfies ``predicate``."""
    found = []
    relax.analysis.post_order_visit(function, lambda e: found.append(isinstance(e, relax.Call) and predicate(e)))
    return any(found)


def bound_value(mutator: relax.PyExprMutator, expr: relax.Expr) -> relax.Expr:
    """What ``expr`` is bound to where it is a variable ``mutator`` has seen bound, else ``expr``."""
    return mutator.lookup_binding(expr) if isinstance(expr, relax.Var) else expr


def int8_dequantize(mutator: relax.PyExprMutator, expr: relax.Expr) -> relax.Call | None:
    """The ``dequantize`` of an int8 or uint8 tensor that ``expr`` is (or is bound to), else None."""
    value = bound_value(mutator, expr)
    if op_name(value) != "relax.dequantize" or value.args[0].ty.dtype not in ("int8", "uint8"):
        return None
    return value


def with_integer_weights(mod: tvm.ir.IRModule, weights: dict[str, np.ndarray]) -> tvm.ir.IRModule:
    """``mod`` with the values of ``main``'s int8/uint8 weight parameters as :data:`INTEGER_WEIGHTS_ATTR`;
    ``weights`` are the parameters after ``main``'s inputs, in their order (the importer renames them: a
    ``.`` is no part of a name there). ``mod`` as it is where it takes none."""
    main = mod["main"]
    num_input = int(main.attrs["num_input"]) if main.attrs and "num_input" in main.attrs else len(main.params)
    params = list(main.params[num_input:])
    if len(params) != len(weights):
        raise ValueError(f"main takes {len(params)} weights, {len(weights)} given")
    names = [param.name for param in params]
    found = {
        name: tvm.runtime.tensor(np.ascontiguousarray(value))
        for name, value in zip(names, weights.values(), strict=True)
        if str(value.dtype) in ("int8", "uint8") and names.count(name) == 1
    }
    return mod.with_attr(INTEGER_WEIGHTS_ATTR, found) if found else mod


def integer_weights(mod: tvm.ir.IRModule) -> dict[relax.Var, np.ndarray]:
    """``main``'s int8/uint8 weight parameters and their values (:func:`with_integer_weights`)."""
    if not mod.attrs or INTEGER_WEIGHTS_ATTR not in mod.attrs:
        return {}
    values = mod.attrs[INTEGER_WEIGHTS_ATTR]
    # Views of the attribute's tensors, not copies: each rewrite of the layout stage reads them.
    return {param: np.from_dlpack(values[param.name]) for param in mod["main"].params if param.name in values}


def without_integer_weights(mod: tvm.ir.IRModule) -> tvm.ir.IRModule:
    """``mod`` without :data:`INTEGER_WEIGHTS_ATTR`: read by the layout stage, of no use past it."""
    return mod.without_attr(INTEGER_WEIGHTS_ATTR) if mod.attrs and INTEGER_WEIGHTS_ATTR in mod.attrs else mod


def integer_value(expr: relax.Expr, weights: dict[relax.Var, np.ndarray]) -> np.ndarray | None:
    """The value of an integer constant, or of an int8/uint8 weight parameter in ``weights``; else None."""
    if isinstance(expr, tvm.ir.GenericConst):
        return expr.value.numpy()
    return weights.get(expr) if isinstance(expr, relax.Var) else None
