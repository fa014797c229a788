"""The lifted weight transform split into one function per transformed weight, each with a digest of what
it computes, so that a model version's buckets share every transformed weight they agree on.

``LiftTransformParams`` makes one ``main_transform_params`` per kernel, returning every weight ``main``
takes: column panels, blocked conv weights, and whatever else is computed from weights alone. Part of
it is the bucket's own: BERT's token-type and position embeddings gathered for the bucket's
``batch x seq`` are weight-only too. Digested whole, two buckets of one model never agreed, and each
loaded kernel computed and held its own copy of every panel (+0.79x the weights per bucket of BERT-base).

Split, each output is computed by a function of its own, ``main_transform_params_<i>``, holding only the
bindings it needs; its digest is the structural hash of that function (names of variables aside,
constants by value, shapes and dtypes included). The server computes an output once per model version
and digest, so a further bucket computes only what is its own.

Runs in the compile child only (imports TVM).
"""

from __future__ import annotations

import hashlib

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from ..running.engines import TRANSFORM_PARAMS, transform_output_name


def _plain_bindings(func: relax.Function) -> tuple[list, relax.Expr, list]:
    """``func``'s bindings, its dataflow vars made plain vars (an output may be returned by a function of
    its own), and its result."""
    plain = relax.transform.ToNonDataflow()(tvm.IRModule({"transform": func}))["transform"]
    bindings = [binding for block in plain.body.blocks for binding in block.bindings]
    return bindings, plain.body.body, plain.params


def _fields(result: relax.Expr, bindings: list) -> list[relax.Expr]:
    bound = {binding.var: binding.value for binding in bindings if isinstance(binding, relax.VarBinding)}
    value = bound.get(result, result) if isinstance(result, relax.Var) else result
    if not isinstance(value, relax.Tuple):
        raise ValueError("the lifted weight transform does not return a tuple")
    return list(value.fields)


def _slice(output: relax.Expr, bindings: list) -> list:
    """The bindings ``output`` depends on, in their order."""
    needed = set(relax.analysis.free_vars(output)) if not isinstance(output, relax.Var) else {output}
    kept = []
    for binding in reversed(bindings):
        if binding.var in needed:
            kept.append(binding)
            needed.update(relax.analysis.free_vars(binding.value))
    return kept[::-1]


def output_bytes(expr: relax.Expr) -> int:
    shape = [int(d) for d in expr.ty.shape.values]
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(str(expr.ty.dtype)).itemsize


def split_weight_transform(mod: tvm.ir.IRModule) -> tvm.ir.IRModule:
    """``mod`` with its lifted ``main_transform_params`` replaced by one function per output (see the
    module's doc); a module without one is returned as it is."""
    if TRANSFORM_PARAMS not in [g_var.name_hint for g_var in mod.get_global_vars()]:
        return mod
    bindings, result, params = _plain_bindings(mod[TRANSFORM_PARAMS])
    split = tvm.IRModule({g_var: func for g_var, func in mod.functions_items() if g_var.name_hint != TRANSFORM_PARAMS})
    if any(result.same_as(param) for param in params):  # lifted nothing: ``main`` reads the weights as they are
        return split
    outputs = _fields(result, bindings)
    for index, output in enumerate(outputs):
        body = relax.SeqExpr([relax.BindingBlock(_slice(output, bindings))], output)
        func = relax.utils.copy_with_new_vars(relax.Function(params, body, output.ty))
        name = transform_output_name(index)
        split[name] = func.with_attr("global_symbol", name)
    return split


def weight_output_facts(mod: tvm.ir.IRModule) -> list[dict] | None:
    """Per transformed weight, in ``main``'s order: its digest and bytes; None without a lifted transform."""
    names = {g_var.name_hint for g_var in mod.get_global_vars()}
    facts = []
    while (name := transform_output_name(len(facts))) in names:
        func = mod[name]
        made_of = f"{tvm_ffi.structural_hash(func)} {func.ret_ty}"
        facts.append({"digest": hashlib.sha256(made_of.encode()).hexdigest(), "bytes": output_bytes(func.body.body)})
    return facts or None
