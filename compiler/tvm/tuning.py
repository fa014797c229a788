"""MetaSchedule tuning of one bucket, and the shared tuning database.

Runs in the compile child only (imports TVM). The shared database is a
MetaSchedule JSON database in the data dir, shared by every bucket and every
restart: a tuning run writes into its own database first and then merges
into the shared one under a file lock, replacing each file in one rename, so
a compile reading it never sees a half-written file.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import importlib.util
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
import types
from contextlib import contextmanager
from pathlib import Path

import tvm
from tvm import relax
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from ..engines import TRANSFORM_PARAMS
from ..errors import CompileError
from .pipeline import tuned_module_passes
from .schedules import default_cpu_rules

RPC_SESSION_SECONDS = 120
"""One candidate's measurement over RPC (upload, load, run) may take this long."""

WORKLOADS = "database_workload.json"
RECORDS = "database_tuning_record.json"


def build_without_tensor_intrinsics(mod, target, _params):
    """MetaSchedule's default builder imports tvm.s_tir.tensor_intrin in every
    fresh worker (15-30 s here) and times out; LLVM/CUDA kernels without tensor
    intrinsics do not need it."""
    from tvm.driver import build as tvm_build
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm_build(mod, target=target)


TENSOR_INTRINSICS = "tvm.s_tir.tensor_intrin"


def intrinsic_families(target_dict: dict) -> tuple[str, ...] | None:
    """The tensor-intrinsic modules MetaSchedule's rules may name for this target; None when unknown."""
    kind = target_dict.get("kind")
    if kind == "cuda":
        return ("cuda", "dot_product_common")
    if kind != "llvm":
        return None
    # An llvm target without a triple compiles for this host.
    arch = str(target_dict.get("mtriple") or platform.machine()).split("-")[0]
    if arch in ("x86_64", "amd64", "i686"):
        return ("x86",)
    if arch.startswith(("aarch64", "arm")):
        return ("arm_cpu",)
    return ("riscv_cpu",) if arch.startswith("riscv") else None


def register_tensor_intrinsics(target_dict: dict) -> None:
    """Register only the target's tensor intrinsics before a TuneContext imports them all.

    TuneContext imports tvm.s_tir.tensor_intrin, whose package parses every family's TVMScript
    (CUDA, ROCm, Arm, Hexagon): 40 s of every tuning run on 2 cores, against 0.4 s for the x86
    ones alone. A bare package module in its place makes that import a no-op; the target's own
    family is then imported into it (also where an earlier tuning run in this process left the bare
    package for another family), so each rule still finds the intrinsics it names."""
    families = intrinsic_families(target_dict)
    if families is None:
        importlib.import_module(TENSOR_INTRINSICS)
        return
    if TENSOR_INTRINSICS not in sys.modules:
        spec = importlib.util.find_spec(TENSOR_INTRINSICS)
        package = types.ModuleType(TENSOR_INTRINSICS, "Tensor intrinsics of the tuning targets' families only.")
        package.__path__ = list(spec.submodule_search_locations)
        package.__package__ = TENSOR_INTRINSICS
        sys.modules[TENSOR_INTRINSICS] = package
    for family in families:
        importlib.import_module(f"{TENSOR_INTRINSICS}.{family}")


@contextmanager
def _locked(directory: Path, exclusive: bool):
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def open_shared_database(directory: str | None):
    """The shared database loaded in memory, or None when there is none yet."""
    if directory is None:
        return None
    path = Path(directory)
    with _locked(path, exclusive=False):
        if not (path / WORKLOADS).is_file() or not (path / RECORDS).is_file():
            return None
        on_disk = ms.database.JSONDatabase(
            path_workload=str(path / WORKLOADS), path_tuning_record=str(path / RECORDS), allow_missing=False
        )
        # A memory copy: later merges by other processes cannot change it under us.
        memory = ms.database.MemoryDatabase()
        _copy_records(on_disk, memory)
        return memory


def _copy_records(source, destination) -> int:
    count = 0
    for record in source.get_all_tuning_records():
        workload = destination.commit_workload(record.workload.mod)
        destination.commit_tuning_record(
            ms.database.TuningRecord(record.trace, workload, record.run_secs, record.target, record.args_info)
        )
        count += 1
    return count


def merge_into_shared(directory: str, run_database) -> int:
    path = Path(directory)
    with _locked(path, exclusive=True):
        staging = Path(tempfile.mkdtemp(prefix=".merge-", dir=path))
        try:
            merged = ms.database.JSONDatabase(work_dir=str(staging))
            if (path / WORKLOADS).is_file() and (path / RECORDS).is_file():
                _copy_records(
                    ms.database.JSONDatabase(
                        path_workload=str(path / WORKLOADS),
                        path_tuning_record=str(path / RECORDS),
                        allow_missing=False,
                    ),
                    merged,
                )
            added = _copy_records(run_database, merged)
            # Workloads first: records only ever point at workloads already there.
            os.replace(staging / WORKLOADS, path / WORKLOADS)
            os.replace(staging / RECORDS, path / RECORDS)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return added


def without_weight_transform(mod: tvm.ir.IRModule) -> tvm.ir.IRModule:
    """``mod`` less the lifted weight transform and its kernels: they run once per model version, and a
    trial spent on them buys no request any time."""
    if not any(g_var.name_hint == TRANSFORM_PARAMS for g_var in mod.get_global_vars()):
        return mod
    kept = tvm.IRModule({g_var: func for g_var, func in mod.functions_items() if g_var.name_hint != TRANSFORM_PARAMS})
    return relax.transform.DeadCodeElimination(["main"])(kept)


def tune(
    mod,
    target_dict: dict,
    *,
    trials: int,
    trials_per_task: int,
    database_dir: str,
    progress_path: str | None = None,
    rpc: tuple[str, str] | None = None,
) -> dict:
    """Tune every task of the fused module; merge the records into the shared database. With ``rpc``
    (tracker ``host:port``, device key) the candidates are measured on the tracker's RPC servers."""
    # Below serving: tuning must not starve requests. SCHED_IDLE runs only on otherwise idle
    # cores (and is inherited by MetaSchedule's builder and runner processes); nice 19 where
    # the policy is not available.
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)
    work_dir = tempfile.mkdtemp(prefix="jitserve-tune-")
    try:
        return _tune(
            mod,
            target_dict,
            trials=trials,
            trials_per_task=trials_per_task,
            work_dir=work_dir,
            database_dir=database_dir,
            progress_path=progress_path,
            rpc=rpc,
        )
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


def _tune(
    mod,
    target_dict: dict,
    *,
    trials: int,
    trials_per_task: int,
    work_dir: str,
    database_dir: str,
    progress_path: str | None,
    rpc: tuple[str, str] | None,
) -> dict:
    started = time.perf_counter()
    # MetaSchedule logs every iteration to stdout, where the CLI prints its results: warnings
    # only, and to stderr (its per-task logs go to the work dir).
    logging.getLogger("tvm.s_tir.meta_schedule").setLevel(logging.WARNING)
    register_tensor_intrinsics(target_dict)
    target = tvm.target.Target(target_dict)
    with target:
        fused = tvm.transform.Sequential(tuned_module_passes(target))(mod)
    fused = without_weight_transform(fused)
    tasks = ms.relax_integration.extract_tasks(fused, target)
    contexts, weights = ms.relax_integration.extracted_tasks_to_tune_contexts(tasks, work_dir=work_dir)
    run_database = ms.database.JSONDatabase(work_dir=work_dir)
    callbacks = ms.measure_callback.MeasureCallback.create("default")
    if progress_path:
        callbacks = [*callbacks, progress_callback(progress_path, [float(w) for w in weights])]
    builder = ms.builder.LocalBuilder(f_build=build_without_tensor_intrinsics, max_workers=1, timeout_sec=120)
    runner, where = make_runner(rpc)
    seeded = record_default_schedules(tasks, target, run_database, builder, runner)
    with contextlib.redirect_stdout(sys.stderr):
        ms.tune_tasks(
            tasks=contexts,
            task_weights=weights,
            work_dir=work_dir,
            max_trials_global=trials,
            max_trials_per_task=trials_per_task,
            num_trials_per_iter=min(16, trials_per_task, trials),
            builder=builder,
            runner=runner,
            database=run_database,
            measure_callbacks=callbacks,
        )
    trials_run = len(run_database.get_all_tuning_records()) - seeded
    merge_into_shared(database_dir, run_database)
    return {
        "tasks": len(tasks),
        "trials": trials_run,
        "default_schedules": seeded,
        "tune_seconds": time.perf_counter() - started,
        "measured_on": where,
    }


def make_runner(rpc: tuple[str, str] | None):
    """MetaSchedule's runner and where it measures: here, or on the RPC servers a tracker holds for a key
    (as many at once as are free)."""
    if rpc is None:
        return ms.runner.LocalRunner(), "local"
    tracker, key = rpc
    host, _, port = tracker.rpartition(":")
    try:
        summary = tvm.rpc.connect_tracker(host, int(port)).summary()
    except Exception as exc:  # noqa: BLE001 - socket errors and TVM's own
        raise CompileError(f"RPC tracker {tracker} cannot be reached: {exc}") from None
    queue = summary.get("queue_info", {}).get(key, {})
    servers = int(queue.get("free", 0)) + int(queue.get("pending", 0))
    if servers < 1:
        raise CompileError(f"RPC tracker {tracker} has no server registered under key {key!r}")
    config = ms.runner.RPCConfig(
        tracker_host=host, tracker_port=int(port), tracker_key=key, session_timeout_sec=RPC_SESSION_SECONDS
    )
    return ms.runner.RPCRunner(rpc_config=config, max_workers=servers), f"rpc {tracker} {key} x{servers}"


def record_default_schedules(tasks, target, database, builder, runner) -> int:
    """Time each task's default schedule with the tuning runner and record it.

    The compile applies a task's best record: with the default schedule among
    them, a tuned kernel is never slower than the untuned one, task by task
    (with a few hundred trials over 50+ tasks, MetaSchedule's picks were often
    slower than the default rules). Returns how many were recorded.
    """
    if target.kind.name != "llvm":  # the default rules are CPU rules
        return 0
    candidates = []
    for task in tasks:
        mod = task.dispatched[0]
        func = mod["main"]
        for rule in default_cpu_rules():
            sch = rule.apply(func, target, False)
            if sch is not None:
                candidates.append((mod, sch, ms.arg_info.ArgInfo.from_prim_func(func)))
                break
    if not candidates:
        return 0
    built = builder.build([ms.builder.BuilderInput(sch.mod, target) for _, sch, _ in candidates])
    measurable = [(c, b) for c, b in zip(candidates, built, strict=True) if b.error_msg is None]
    futures = runner.run([ms.runner.RunnerInput(b.artifact_path, "cpu", args) for (_, _, args), b in measurable])
    recorded = 0
    for ((mod, sch, args), _), future in zip(measurable, futures, strict=True):
        result = future.result()
        if result.error_msg is None and result.run_secs:
            workload = database.commit_workload(mod)
            database.commit_tuning_record(ms.database.TuningRecord(sch.trace, workload, result.run_secs, target, args))
            recorded += 1
    return recorded


def progress_callback(path: str, weights: list[float]):
    """A measure callback writing ``{"trials", "best_ms"}`` to ``path`` after every batch of trials.

    ``best_ms`` estimates the tuned kernel from the tasks measured so far: the
    sum over tasks of their fastest candidate, times how often the model
    calls each.
    """

    @derived_object
    class Progress(ms.measure_callback.PyMeasureCallback):
        def __init__(self) -> None:
            self.trials = 0
            self.best: dict[int, float] = {}

        def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results) -> None:
            for result in runner_results:
                self.trials += 1
                if result.error_msg is None and result.run_secs:
                    seconds = sum(float(s) for s in result.run_secs) / len(result.run_secs)
                    self.best[task_id] = min(seconds, self.best.get(task_id, seconds))
            best_ms = sum(weights[i] * s for i, s in self.best.items()) * 1000 if self.best else None
            temporary = f"{path}.{os.getpid()}.tmp"
            with open(temporary, "w") as handle:
                json.dump({"trials": self.trials, "best_ms": best_ms}, handle)
            os.replace(temporary, path)

    return Progress()
