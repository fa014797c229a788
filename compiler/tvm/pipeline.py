"""The Relax pipeline jitserve compiles with, as named stages.

    dispatch -> fuse (legalize, fold, FuseOps, FuseTIR) -> [vectorizable math, CPU]
    -> [tuning records]
    -> default schedules -> dataflow lowering -> finalize

Tuned records (MetaSchedule, when a database is given) are applied before
the default schedules, which skip functions already scheduled. Runs in the
compile child only (imports TVM). The stages' identity in artifact keys is
``compiler.tvm.PIPELINE`` (with ``COMPILER_VERSION``): change them together.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.s_tir import dlight as dl

from .schedules import default_cpu_rules, vectorizable_math_pass


def _backend(target: tvm.target.Target):
    # The packages re-export only some stage lists; their pipeline modules have all four.
    if target.kind.name == "cuda":
        return relax.backend.cuda.pipeline
    if target.kind.name == "llvm":
        return relax.backend.cpu_generic.pipeline
    raise ValueError(f"unsupported target kind {target.kind.name!r}")


def fusion_passes() -> list:
    return [
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
    ]


def default_schedule_pass(target: tvm.target.Target):
    if target.kind.name == "cuda":
        return dl.ApplyDefaultSchedule(
            dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()
        )
    return dl.ApplyDefaultSchedule(*default_cpu_rules())


def tuned_module_passes(target: tvm.target.Target) -> list:
    """Everything up to (and including) fusion: the TIR functions that tuning sees."""
    math = [vectorizable_math_pass()] if target.kind.name == "llvm" else []
    return _backend(target).library_dispatch_passes(target) + fusion_passes() + math


def build_pipeline(target: tvm.target.Target, database=None) -> tvm.transform.Pass:
    backend = _backend(target)

    def stages() -> list:
        # Built under the target: MetaScheduleApplyDatabase reads Target.current() when constructed.
        tuned = [relax.transform.MetaScheduleApplyDatabase(enable_warning=False)] if database is not None else []
        return (
            tuned_module_passes(target)
            + tuned
            + [default_schedule_pass(target)]
            + backend.dataflow_lower_passes(target)
            + backend.finalize_passes(target)
        )

    @tvm.transform.module_pass(opt_level=0, name="jitserve_pipeline")
    def _pipeline(mod: tvm.ir.IRModule, _ctx: tvm.transform.PassContext) -> tvm.ir.IRModule:
        with target:
            if database is None:
                return tvm.transform.Sequential(stages())(mod)
            with database:
                return tvm.transform.Sequential(stages())(mod)

    return _pipeline
