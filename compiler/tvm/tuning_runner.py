"""How tuning measures: candidates timed cold by MetaSchedule's runner, here or over RPC; the default
schedules recorded as every task's first record; the progress a bucket's tuning shows live.

Runs in the compile child only (imports TVM).
"""

from __future__ import annotations

import json
import os

import tvm
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from ..errors import CompileError
from .schedules import default_cpu_rules

RPC_SESSION_SECONDS = 120
"""One candidate's measurement over RPC (upload, load, run) may take this long."""


def mean_seconds(run_secs) -> float:
    return sum(float(s) for s in run_secs) / len(run_secs)


COLD_RUNS = 5
"""Timed runs of one candidate, each after its weights are flushed from the caches."""
CONFIRM_CANDIDATES = 3
"""A task's fastest candidates re-timed against the schedule it had before it is given a new one."""
CONFIRM_RUNS = 10
"""Timed runs of each in every one of ``CONFIRM_ROUNDS`` turns."""
CONFIRM_ROUNDS = 2


def cold_weights_evaluator(runs: int = COLD_RUNS):
    """Each candidate timed run by run with every argument but the first (its input) flushed from the CPU
    caches first, as a kernel meets its weights in a served model: the kernels before it evicted them.
    MetaSchedule's default times a candidate over and over on the same arguments for 100 ms, all of them in
    cache. (Timing cold alone did not make the fastest candidate's record trustworthy: see
    ``TuningRun._confirm_faster``.)"""
    return ms.runner.EvaluatorConfig(number=1, repeat=runs, min_repeat_ms=0, enable_cpu_cache_flush=True)


def make_runner(rpc: tuple[str, str] | None, runs: int = COLD_RUNS):
    """MetaSchedule's runner and where it measures: here, or on the RPC servers a tracker holds for a key
    (as many at once as are free); candidates are timed with cold weights (:func:`cold_weights_evaluator`)."""
    if rpc is None:
        return ms.runner.LocalRunner(evaluator_config=cold_weights_evaluator(runs)), "local"
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
    runner = ms.runner.RPCRunner(rpc_config=config, evaluator_config=cold_weights_evaluator(runs), max_workers=servers)
    return runner, f"rpc {tracker} {key} x{servers}"


def record_default_schedules(tasks, target, database, builder, runner) -> list[float | None]:
    """Time each task's default schedule with the tuning runner and record it; returns each task's
    seconds (None where no default rule took it or it did not build or run).

    The compile applies a task's best record: with the default schedule among
    them, a tuned kernel is never slower than the untuned one, task by task
    (with a few hundred trials over 50+ tasks, MetaSchedule's picks were often
    slower than the default rules).
    """
    seconds: list[float | None] = [None] * len(tasks)
    if target.kind.name != "llvm":  # the default rules are CPU rules
        return seconds
    candidates = []
    for index, task in enumerate(tasks):
        mod = task.dispatched[0]
        func = mod["main"]
        for rule in default_cpu_rules():
            sch = rule.apply(func, target, False)
            if sch is not None:
                candidates.append((index, mod, sch, ms.arg_info.ArgInfo.from_prim_func(func)))
                break
    if not candidates:
        return seconds
    built = builder.build([ms.builder.BuilderInput(sch.mod, target) for _, _, sch, _ in candidates])
    measurable = [(c, b) for c, b in zip(candidates, built, strict=True) if b.error_msg is None]
    futures = runner.run([ms.runner.RunnerInput(b.artifact_path, "cpu", args) for (*_, args), b in measurable])
    for ((index, mod, sch, args), _), future in zip(measurable, futures, strict=True):
        result = future.result()
        if result.error_msg is None and result.run_secs:
            workload = database.commit_workload(mod)
            database.commit_tuning_record(ms.database.TuningRecord(sch.trace, workload, result.run_secs, target, args))
            seconds[index] = mean_seconds(result.run_secs)
    return seconds


class Progress:
    """``{"trials", "best_ms"}`` written to a file after every batch of trials (the server shows it live).

    ``best_ms`` estimates the tuned kernel: the sum over tasks of their fastest
    schedule measured so far (their default one to begin with), times how
    often the model calls each."""

    def __init__(self, path: str | None, tasks: dict[str, tuple[int, float]]) -> None:
        self.path = path
        self.calls = {name: calls for name, (calls, _) in tasks.items()}
        self.best = {name: seconds for name, (_, seconds) in tasks.items() if seconds}
        self.trials = 0
        self.tasks_tuned = 0

    def write(self) -> None:
        if not self.path:
            return
        best_ms = sum(self.calls[name] * s for name, s in self.best.items()) * 1000 if self.best else None
        temporary = f"{self.path}.{os.getpid()}.tmp"
        with open(temporary, "w") as handle:
            json.dump({"trials": self.trials, "best_ms": best_ms}, handle)
        os.replace(temporary, self.path)

    def measured(self, task_name: str, trials: int, database, mod) -> None:
        """Count ``trials`` measured outside MetaSchedule, their fastest being ``database``'s best for ``mod``."""
        self.trials += trials
        # A JSON database's top-k reserves room for k records: 1 here, never "all".
        for record in database.get_top_k(database.commit_workload(mod), 1) if database.has_workload(mod) else []:
            seconds = mean_seconds(record.run_secs)
            self.best[task_name] = min(seconds, self.best.get(task_name, seconds))
        self.write()

    def callback(self, task_name: str):
        """A measure callback counting one task's trials into this progress."""
        progress = self

        @derived_object
        class Measured(ms.measure_callback.PyMeasureCallback):
            def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results) -> None:
                for result in runner_results:
                    progress.trials += 1
                    if result.error_msg is None and result.run_secs:
                        seconds = mean_seconds(result.run_secs)
                        progress.best[task_name] = min(seconds, progress.best.get(task_name, seconds))
                progress.write()

        return Measured()
