"""CUDA graphs for a static bucket's VM call: its kernels launched as a few captured graphs, replayed on
every later call, instead of one launch (a few microseconds of host and driver work) per kernel.

TVM's ``RewriteCUDAGraph`` (the ``relax.backend.use_cuda_graph`` pass option) lifts into capture functions
the runs of kernels whose tensors are all static: planned storage, held between calls, and the weights (the
parameters after ``num_input``). A kernel that reads a call's input tensor (a fresh tensor per call) cannot be
captured, nor can the kernel writing the returned tensor. An encoder layer's input is read by its Q, K and V
projections and its residual, so four kernels would launch alone. :func:`stage_inputs_pass` copies each input
into a planned tensor first: one copy kernel per input launches alone, and the kernels that read the input
move into the graphs.

A VM call with captured graphs is not reentrant: its planned storage is held by the VM between calls. A
:class:`~compiler.running.engines.TvmEngine` runs one call at a time.

Asked for with :data:`CUDA_GRAPH_ATTR` on the module (``compile_relax(..., cuda_graph=True)``). Runs in the
compile child only (imports TVM).
"""

from __future__ import annotations

import tvm
from tvm import relax, te

CUDA_GRAPH_ATTR = "jitserve_cuda_graph"
"""A module attribute: its compile captures CUDA graphs (its inputs staged by :func:`stage_inputs_pass`)."""
CUDA_GRAPH_OPTION = "relax.backend.use_cuda_graph"
"""The pass-context option under which TVM's CUDA finalization runs ``RewriteCUDAGraph``."""


def wants_cuda_graph(mod: tvm.ir.IRModule) -> bool:
    return bool(mod.attrs) and CUDA_GRAPH_ATTR in mod.attrs and bool(mod.attrs[CUDA_GRAPH_ATTR])


def _copy_kernel(shape: list[int], dtype: str) -> tvm.tirx.PrimFunc:
    source = te.placeholder(shape, dtype, name="input")
    staged = te.compute(shape, lambda *index: source(*index), name="staged")  # noqa: PLW0108 - te reads its arity
    return te.create_prim_func([source, staged])


def _static_shape(param: relax.Var) -> list[int] | None:
    shape = getattr(param.ty, "shape", None)
    values = getattr(shape, "values", None)
    if values is None or not all(isinstance(v, tvm.tirx.IntImm) for v in values):
        return None
    return [int(v) for v in values]


def stage_inputs(mod: tvm.ir.IRModule) -> tuple[tvm.ir.IRModule, int]:
    """``mod`` whose ``main`` first copies each static input into a tensor of its own (which the memory
    planner plans), every later use reading the copy; and how many inputs it staged."""
    main = mod["main"]
    num_input = int(main.attrs["num_input"]) if main.attrs and "num_input" in main.attrs else len(main.params)
    builder = relax.BlockBuilder(mod)
    fresh, bindings, substitute = [], [], {}
    for param in main.params[:num_input]:
        shape = _static_shape(param)
        outer = relax.Var(param.name, param.ty)
        fresh.append(outer)
        if shape is None:
            substitute[param] = outer
            continue
        kernel = builder.add_func(_copy_kernel(shape, param.ty.dtype), "stage_input")
        staged = relax.Var(f"{param.name}_staged", param.ty)
        bindings.append(relax.VarBinding(staged, relax.call_tir(kernel, [outer], out_ty=param.ty)))
        substitute[param] = staged
    if not bindings:
        return mod, 0
    body = main.bind_params(substitute).body  # the inputs' uses read the copies; the weights stay parameters
    staged_main = relax.Function(
        [*fresh, *main.params[num_input:]],
        relax.SeqExpr([relax.BindingBlock(bindings), *body.blocks], body.body),
        main.ret_ty,
        main.is_pure,
        main.attrs,
    )
    builder.update_func(mod.get_global_var("main"), staged_main)
    return builder.get(), len(bindings)


@tvm.transform.module_pass(opt_level=0, name="jitserve_stage_inputs")
def stage_inputs_pass(mod: tvm.ir.IRModule, _ctx: tvm.transform.PassContext) -> tvm.ir.IRModule:
    """After fusion (a copy fused into its readers would read the input again) and before the schedules
    (which schedule the copies)."""
    return stage_inputs(mod)[0] if wants_cuda_graph(mod) else mod


def graph_facts(mod: tvm.ir.IRModule) -> dict[str, int]:
    """Of a lowered module: how many graphs ``main`` replays, and how many kernel launches are in them and
    outside them (``launched_alone``) per call."""
    kernels = {gv for gv, func in mod.functions_items() if isinstance(func, tvm.tirx.PrimFunc)}

    def launches(function: relax.Function) -> int:
        found = []
        relax.analysis.post_order_visit(function, lambda e: found.append(isinstance(e, relax.Call) and e.op in kernels))
        return sum(found)

    captures = [func for gv, func in mod.functions_items() if "_cuda_graph_capture" in gv.name_hint]
    return {
        "graphs": len(captures),
        "kernels_in_graphs": sum(launches(func) for func in captures),
        "launched_alone": launches(mod["main"]),
    }
