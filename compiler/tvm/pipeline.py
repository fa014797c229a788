"""The Relax pipeline jitserve compiles with, as named stages.

    dispatch -> layout (channel-blocked convs, CPU; weight transforms lifted) -> legalize -> fold constants
    -> fuse (FuseOps, FuseTIR, [vectorizable math, CPU])
    -> [apply tuning records] -> schedule (default rules) -> lower (dataflow lowering, finalize)

Each stage's wall time can be collected (the manifest's ``compile_stages``).

Tuned records (MetaSchedule, when a database is given) are applied before
the default schedules, which skip functions already scheduled. Runs in the
compile child only (imports TVM). The stages' identity in artifact keys is
``compiler.tvm.PIPELINE`` (with ``COMPILER_VERSION``): change them together.
"""

from __future__ import annotations

import hashlib
import logging
import time

import tvm
from tvm import relax, tirx
from tvm.s_tir import dlight as dl

from .cuda_graphs import graph_facts, stage_inputs_pass, wants_cuda_graph
from .layout import channel_block_passes
from .legalize import custom_legalizations
from .schedules import SymbolicBounds, default_cpu_rules, vectorizable_math_pass
from .schedules.base import UNIT_ANNOTATION
from .shared_kernels import scalar_operands_pass
from .tensor_cores import tensor_core_pass
from .weight_transform import weight_output_facts

_log = logging.getLogger(__name__)


def _backend(target: tvm.target.Target):
    # The packages re-export only some stage lists; their pipeline modules have all four.
    if target.kind.name == "cuda":
        return relax.backend.cuda.pipeline
    if target.kind.name == "llvm":
        return relax.backend.cpu_generic.pipeline
    raise ValueError(f"unsupported target kind {target.kind.name!r}")


def tuned_module_stages(
    target: tvm.target.Target, symbolic_bounds: SymbolicBounds | None = None
) -> list[tuple[str, list]]:
    """Everything up to (and including) fusion, as named stages: the TIR functions that tuning sees."""
    math = [vectorizable_math_pass()] if target.kind.name == "llvm" else []

    @tvm.transform.module_pass(opt_level=0, name="jitserve_legalize")
    def legalize(mod: tvm.ir.IRModule, _ctx: tvm.transform.PassContext) -> tvm.ir.IRModule:
        # A fresh map per run: it remembers the kernels that run built.
        return relax.transform.LegalizeOps(custom_legalizations(symbolic_bounds))(mod)

    return [
        ("dispatch", _backend(target).library_dispatch_passes(target)),
        ("layout", [*channel_block_passes(target), *([tensor_core_pass] if target.kind.name == "cuda" else [])]),
        ("legalize", [scalar_operands_pass, legalize, relax.transform.AnnotateTIROpPattern()]),
        ("fold_constants", [relax.transform.FoldConstant()]),
        ("fuse", [relax.transform.FuseOps(), relax.transform.FuseTIR(), *math]),
    ]


def tuned_module_passes(target: tvm.target.Target) -> list:
    return [p for _, passes in tuned_module_stages(target) for p in passes]


TUNING_RECORD = "tuning record"
"""What scheduled a kernel that MetaScheduleApplyDatabase scheduled from the tuning database."""
TOPI_SCHEDULE = "TOPI"
"""What scheduled a kernel that arrives scheduled by its TOPI implementation: one opaque block with parallel
loops and no root block for a rule to read (a CumSum over a symbolic sequence, parallel across the rows it
scans)."""


def default_rules(target: tvm.target.Target, symbolic_bounds: SymbolicBounds | None = None) -> list:
    if target.kind.name == "cuda":
        return [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()]
    return default_cpu_rules(symbolic_bounds)


def _scheduled_by_topi(func: tirx.PrimFunc) -> bool:
    """Whether ``func``'s body is an opaque block (no root block) whose loops TOPI already made parallel."""
    block = getattr(func.body, "block", None)
    if block is None or block.name_hint == "root":
        return False
    pending = [block.body]
    while pending:  # the statements under it, through their bodies and branches
        stmt = pending.pop()
        if isinstance(stmt, tirx.For) and stmt.kind == tirx.ForKind.PARALLEL:
            return True
        pending.extend(getattr(stmt, "seq", None) or [])
        pending.extend(x for x in (getattr(stmt, f, None) for f in ("body", "block", "then_case", "else_case")) if x)
    return False


def kernel_unit(func: tirx.PrimFunc) -> str | None:
    """The unit a scheduled kernel's rule ran its arithmetic on (``int8 on avx2 (vpmaddwd)``); None for
    the vector unit's float arithmetic."""
    block = getattr(func.body, "block", None)
    unit = block.annotations.get(UNIT_ANNOTATION) if block is not None else None
    return None if unit is None else str(unit)


def default_schedule_pass(
    target: tvm.target.Target,
    symbolic_bounds: SymbolicBounds | None = None,
    schedules: dict[str, str | None] | None = None,
    units: dict[str, str] | None = None,
) -> tvm.transform.Pass:
    """dlight's ApplyDefaultSchedule (the first rule that matches a kernel schedules it), recording in
    ``schedules`` what scheduled each kernel: a rule's class name, ``TUNING_RECORD``, or None where no
    rule matched (the kernel then runs as naive loops: every one is a finding); and in ``units`` the unit
    of each kernel a rule ran on one (:func:`kernel_unit`)."""
    rules = default_rules(target, symbolic_bounds)
    record = schedules if schedules is not None else {}

    def schedule(func: tirx.PrimFunc, name: str) -> tirx.PrimFunc | None:
        if func.attrs and func.attrs.get("tirx.is_scheduled"):
            record[name] = TUNING_RECORD
            return None
        if _scheduled_by_topi(func):
            record[name] = TOPI_SCHEDULE
            return None
        target_here = func.attrs.get("target") if func.attrs else None
        for rule in rules:
            try:
                space = rule.apply(func, target_here or tvm.target.Target.current(allow_none=False), False)
            except (AssertionError, RuntimeError, ValueError) as error:
                # dlight's GPU Matmul asserts on a fused epilogue it cannot inline (a conv with a SiLU or
                # hardswish after it, on CUDA): a rule that fails on a kernel declines it, and the next tries.
                _log.info("%s declined %s: %s: %s", type(rule).__name__, name, type(error).__name__, error)
                continue
            if space is not None:
                record[name] = type(rule).__name__
                chosen = space[0] if isinstance(space, list) else space
                unit = kernel_unit(chosen.mod["main"])
                if unit and units is not None:
                    units[name] = unit
                return chosen.mod["main"].with_attr("tirx.is_scheduled", True)
        record[name] = None
        return None

    @tvm.transform.module_pass(opt_level=0, name="jitserve_default_schedule")
    def apply(mod: tvm.ir.IRModule, _ctx: tvm.transform.PassContext) -> tvm.ir.IRModule:
        updated = {}
        for g_var, func in mod.functions_items():
            if isinstance(func, tirx.PrimFunc) and (scheduled := schedule(func, g_var.name_hint)) is not None:
                updated[g_var] = scheduled
        for g_var, func in updated.items():
            mod[g_var] = func
        return mod

    return apply


def schedule_digest(mod: tvm.ir.IRModule) -> str:
    """sha256 of the scheduled TIR functions: two compiles that chose the same schedules (from the same
    tuning records) have the same digest, whichever process or machine tuned them."""
    functions = sorted(
        (gv.name_hint, func.script()) for gv, func in mod.functions.items() if isinstance(func, tvm.tirx.PrimFunc)
    )
    return hashlib.sha256("\n".join(text for _, text in functions).encode()).hexdigest()


def build_pipeline(
    target: tvm.target.Target,
    database=None,
    stage_seconds: dict[str, float] | None = None,
    observed: dict | None = None,
    symbolic_bounds: SymbolicBounds | None = None,
    *,
    snapshot=None,
) -> tvm.transform.Pass:
    """The pipeline as one pass; ``stage_seconds`` (when given) receives each stage's wall time and
    ``observed`` the ``schedule_digest`` of the scheduled module, as ``schedules`` what scheduled
    each kernel (see :func:`default_schedule_pass`), and as ``weight_outputs`` the digest and bytes of each
    output of the weights' lifted transform, where there is one. ``symbolic_bounds``: the range of
    each symbolic dim (the dynamic tier), which the CPU schedules plan their tiles and threads with.
    ``snapshot(stage, mod)`` (when given) is called after each stage, and after ``FuseOps`` alone
    (``fuse_ops``): what an explain bundle shows and traces the kernels through. The module is
    only borrowed: later stages may change it in place."""
    backend = _backend(target)
    schedules: dict[str, str | None] = {}
    units: dict[str, str] = {}

    def stages() -> list[tuple[str, list]]:
        # Built under the target: MetaScheduleApplyDatabase reads Target.current() when constructed.
        tuned = [relax.transform.MetaScheduleApplyDatabase(enable_warning=False)] if database is not None else []
        graph_staging = [stage_inputs_pass] if target.kind.name == "cuda" else []
        return [
            *tuned_module_stages(target, symbolic_bounds),
            ("apply_tuning_records", tuned),
            ("schedule", [*graph_staging, default_schedule_pass(target, symbolic_bounds, schedules, units)]),
            ("lower", backend.dataflow_lower_passes(target) + backend.finalize_passes(target)),
        ]

    def run(mod: tvm.ir.IRModule) -> tvm.ir.IRModule:
        for name, passes in stages():
            started = time.perf_counter()
            rest = passes
            if snapshot is not None and name == "fuse":
                mod = passes[0](mod)  # FuseOps: its fused functions still list the bindings they hold
                snapshot("fuse_ops", mod)
                rest = passes[1:]
            mod = tvm.transform.Sequential(rest)(mod)
            if snapshot is not None and passes:  # a stage without passes left the module as it was
                snapshot(name, mod)
            if stage_seconds is not None:
                stage_seconds[name] = stage_seconds.get(name, 0.0) + time.perf_counter() - started
            if name == "layout" and observed is not None:
                observed["weight_outputs"] = weight_output_facts(mod)
            if name == "lower" and observed is not None and wants_cuda_graph(mod):
                observed["cuda_graph"] = graph_facts(mod)
            if name == "schedule" and observed is not None:
                observed["schedule_digest"] = schedule_digest(mod)
                observed["schedules"] = dict(sorted(schedules.items()))
                observed["units"] = dict(sorted(units.items()))
        return mod

    @tvm.transform.module_pass(opt_level=0, name="jitserve_pipeline")
    def _pipeline(mod: tvm.ir.IRModule, _ctx: tvm.transform.PassContext) -> tvm.ir.IRModule:
        with target:
            if database is None:
                return run(mod)
            with database:
                return run(mod)

    return _pipeline
