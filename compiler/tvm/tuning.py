"""MetaSchedule tuning of one bucket into the shared tuning database (:mod:`.tuning_database`).

Runs in the compile child only (imports TVM). The bucket's tasks are ranked
by what they lose (:mod:`compiler.measuring.tuning_plan`) and tuned one at a time, the
most costly first, each merged into the shared database as it ends: a run
stopped at its time limit keeps what it tuned.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass

import tvm
from tvm import relax
from tvm.s_tir import meta_schedule as ms

from ..measuring.tuning_plan import BUDGET_SPENT, TaskCost, confirmed_winner, plan_tuning
from ..running.engines import TRANSFORM_PARAMS
from .knob_search import knobs_of, search_knobs
from .pipeline import tuned_module_passes
from .tensor_intrinsics import register_tensor_intrinsics
from .tuning_database import SHIPPED_DIR, merge_into_shared, open_shared_database, read_trials, records_of, workload_key
from .tuning_runner import (
    CONFIRM_CANDIDATES,
    CONFIRM_ROUNDS,
    CONFIRM_RUNS,
    Progress,
    make_runner,
    mean_seconds,
    record_default_schedules,
)


def build_without_tensor_intrinsics(mod, target, _params):
    """MetaSchedule's default builder imports tvm.s_tir.tensor_intrin in every
    fresh worker (15-30 s here) and times out; LLVM/CUDA kernels without tensor
    intrinsics do not need it."""
    from tvm.driver import build as tvm_build
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm_build(mod, target=target)


def without_weight_transform(mod: tvm.ir.IRModule) -> tvm.ir.IRModule:
    """``mod`` less the lifted weight transform and its kernels: they run once per model version, and a
    trial spent on them buys no request any time."""
    if not any(g_var.name_hint.startswith(TRANSFORM_PARAMS) for g_var in mod.get_global_vars()):
        return mod
    kept = tvm.IRModule(
        {g_var: func for g_var, func in mod.functions_items() if not g_var.name_hint.startswith(TRANSFORM_PARAMS)}
    )
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
    kernel_times: dict[str, tuple[float | None, float | None]] | None = None,
    seconds: float | None = None,
    shipped_dir=SHIPPED_DIR,
) -> dict:
    """Tune the fused module's tasks that lose most (:mod:`compiler.measuring.tuning_plan`), one at a time, each
    merged into the shared database as it ends. With ``rpc`` (tracker ``host:port``, device key) the
    candidates are measured on the tracker's RPC servers. ``kernel_times``: the untuned kernel's explain
    profile (kernel -> its ms, ONNX Runtime's ms), which ranks the tasks; ``seconds``: no task starts that
    would not end within this (the build and verification come after)."""
    # Below serving: tuning must not starve requests. SCHED_IDLE runs only on otherwise idle
    # cores (and is inherited by MetaSchedule's builder and runner processes); nice 19 where
    # the policy is not available.
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)
    work_dir = tempfile.mkdtemp(prefix="jitserve-tune-")
    try:
        run = TuningRun(target_dict, database_dir, work_dir, rpc, progress_path, shipped_dir=shipped_dir)
        return run.tune(mod, trials, trials_per_task, kernel_times or {}, seconds)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


class TuningRun:
    """One bucket's tuning: its tasks timed with their default schedules, ranked, tuned in that order."""

    def __init__(
        self,
        target_dict: dict,
        database_dir: str,
        work_dir: str,
        rpc: tuple[str, str] | None,
        progress_path,
        *,
        shipped_dir=SHIPPED_DIR,
    ) -> None:
        # MetaSchedule logs every iteration to stdout, where the CLI prints its results: warnings
        # only, and to stderr (its per-task logs go to the work dir).
        logging.getLogger("tvm.s_tir.meta_schedule").setLevel(logging.WARNING)
        register_tensor_intrinsics(target_dict)
        self.target = tvm.target.Target(target_dict)
        self.database_dir = database_dir
        self.shipped_dir = shipped_dir
        self.work_dir = work_dir
        self.builder = ms.builder.LocalBuilder(f_build=build_without_tensor_intrinsics, max_workers=1, timeout_sec=120)
        self.runner, self.measured_on = make_runner(rpc)
        self.confirmer, _ = make_runner(rpc, runs=CONFIRM_RUNS)
        self.confirmations = 0
        """Candidates re-timed side by side (each a measurement, as a trial is)."""
        self.progress_path = progress_path

    def tune(self, mod, trials: int, trials_per_task: int, kernel_times: dict, seconds: float | None) -> dict:
        started = time.perf_counter()
        with self.target:
            fused = tvm.transform.Sequential(tuned_module_passes(self.target))(mod)
        tasks = ms.relax_integration.extract_tasks(without_weight_transform(fused), self.target)
        costs, timed = self._costs(tasks, kernel_times)
        plan = plan_tuning(costs, trials, trials_per_task)
        progress = Progress(self.progress_path, {cost.name: (cost.calls, cost.seconds) for cost in costs})
        progress.write()
        by_name = {task.task_name: task for task in tasks}
        tuned: dict[str, TaskTuned] = {}
        left = trials
        for step in (step for step in plan if step.trials or step.reason == BUDGET_SPENT):
            given = min(trials_per_task - step.task.tuned_trials, left)
            if seconds is not None and tuned:  # as many as the time left holds at the pace so far
                elapsed = time.perf_counter() - started
                given = min(given, int((seconds - elapsed) / (elapsed / max(1, sum(t.trials for t in tuned.values())))))
            if given < 1:
                break
            tuned[step.task.name] = self._tune_task(by_name[step.task.name], given, progress)
            left -= tuned[step.task.name].trials
        return {
            "tasks": len(tasks),
            "trials": sum(t.trials for t in tuned.values()),
            "default_schedules": timed,
            "confirmations": self.confirmations,
            "tune_seconds": time.perf_counter() - started,
            "measured_on": self.measured_on,
            "plan": [self._planned(step, tuned.get(step.task.name, TaskTuned())) for step in plan],
        }

    def _costs(self, tasks, kernel_times: dict) -> tuple[list[TaskCost], int]:
        """Each task's cost, and how many default schedules were timed for it. A task the shared database
        holds records for is timed by its fastest; the others with their default schedules, recorded so
        that a tuned kernel is never slower than the untuned one, task by task."""
        shared = self._shared()
        ledger = read_trials(self.database_dir)
        known = [records_of(shared, task.dispatched[0], self.target) for task in tasks]
        untimed = [task for task, records in zip(tasks, known, strict=True) if not records]
        defaults = self._database("defaults")
        measured = record_default_schedules(untimed, self.target, defaults, self.builder, self.runner)
        merge_into_shared(self.database_dir, defaults)
        timed = dict(zip((task.task_name for task in untimed), measured, strict=True))
        costs = []
        for task, records in zip(tasks, known, strict=True):
            profiled_ms, ort_ms = kernel_times.get(task.task_name, (None, None))
            seconds = mean_seconds(records[0].run_secs) if records else timed[task.task_name]
            spent = ledger.get(workload_key(task.dispatched[0]), 0)
            costs.append(TaskCost(task.task_name, int(task.weight), seconds or 0.0, profiled_ms, ort_ms, spent))
        return costs, sum(1 for value in measured if value is not None)

    @staticmethod
    def _planned(step, tuned: TaskTuned) -> dict:
        """A plan row as run: its trials, one call of its kernel before (the runner's µs) and, where a
        candidate was confirmed faster, after (and the knobs it turned, where it was a knob candidate)."""
        before = step.task.seconds
        row = step.as_dict() | {"trials": tuned.trials, "default_us": round(before * 1e6, 1) if before else None}
        if tuned.trials:  # tuned with the budget the tasks before it left
            row["reason"] = None
        if tuned.seconds:
            row["tuned_us"] = round(tuned.seconds * 1e6, 1)
        return row | ({"knobs": tuned.knobs} if tuned.knobs is not None else {})

    def _confirm_faster(self, mod, tuned, incumbent, confirmed) -> float | None:
        """Re-time ``tuned``'s fastest candidates for ``mod`` against ``incumbent`` (the record a compile
        applies now; None: none yet), side by side and turn by turn; commit into ``confirmed`` the fastest
        of those that beat it (:func:`compiler.measuring.tuning_plan.confirmed_winner`). Returns its seconds, or None
        where none did.

        The fastest of hundreds of noisy measurements is the luckiest, not the fastest: on 2 shared cores,
        BERT's FFN GEMM's best candidate was recorded at 4.6 ms (five cold runs of 4.1 to 5.3) against 5.3
        for its default schedule, re-timed at 5.4 and ran 12% slower in the model. The confirmed record is
        committed at the incumbent's recorded time scaled by the ratio measured here, so the database orders
        the two as this side-by-side timing did."""
        # The incumbent's own schedule among them (a knob search measures the default too) is no contender.
        same = str(incumbent.trace) if incumbent is not None else None
        best = [r for r in tuned.get_top_k(tuned.commit_workload(mod), CONFIRM_CANDIDATES + 1) if str(r.trace) != same]
        best = best[:CONFIRM_CANDIDATES]
        if not best:
            return None
        contenders = ([incumbent] if incumbent is not None else []) + best
        measured = self._side_by_side(contenders)
        first = len(contenders) - len(best)
        if incumbent is not None and 0 not in measured:
            return None
        baseline = measured.get(0) if incumbent is not None else None
        winner = confirmed_winner(baseline, {i: t for i, t in measured.items() if i >= first})
        if winner is None:
            return None
        seconds = measured[winner]
        if baseline is not None:
            seconds = mean_seconds(incumbent.run_secs) * seconds / baseline
        record = contenders[winner]
        workload = confirmed.commit_workload(mod)
        confirmed.commit_tuning_record(
            ms.database.TuningRecord(record.trace, workload, [seconds], self.target, record.args_info)
        )
        return seconds

    def _side_by_side(self, records) -> dict[int, float]:
        """Each record's median seconds (by index), timed in turns: a slow spell weighs on all alike."""
        candidates = [record.as_measure_candidate() for record in records]
        built = self.builder.build([ms.builder.BuilderInput(c.sch.mod, self.target) for c in candidates])
        device = "cuda" if self.target.kind.name == "cuda" else "cpu"
        runnable = [(i, ms.runner.RunnerInput(b.artifact_path, device, candidates[i].args_info))
                    for i, b in enumerate(built) if b.error_msg is None]  # fmt: skip
        times: dict[int, list[float]] = {i: [] for i, _ in runnable}
        for _ in range(CONFIRM_ROUNDS):
            self.confirmations += len(runnable)
            for (i, _), future in zip(runnable, self.confirmer.run([r for _, r in runnable]), strict=True):
                result = future.result()
                if result.error_msg is None and result.run_secs:
                    times[i] += [float(seconds) for seconds in result.run_secs]
        return {i: sorted(t)[len(t) // 2] for i, t in times.items() if t}

    def _shared(self):
        """The shared database as it stands now, with the shipped records (where they are applied)."""
        return open_shared_database(self.database_dir, self.target, shipped_dir=self.shipped_dir)

    def _database(self, name: str):
        directory = os.path.join(self.work_dir, name)
        os.makedirs(directory)
        return ms.database.JSONDatabase(work_dir=directory)

    def _tune_task(self, task, trials: int, progress: Progress) -> TaskTuned:
        """Tune one task for ``trials``: the rules' knobs first (:mod:`.knob_search`), then MetaSchedule with
        what is left, where that is enough for a search; merge what ``_confirm_faster`` confirms into the
        shared database."""
        database = self._database(f"task-{progress.tasks_tuned}")
        mod = task.dispatched[0]
        candidates = []
        if self.target.kind.name == "llvm":  # the knobs are the CPU rules'
            candidates = search_knobs(mod, self.target, self.builder, self.runner, database, limit=trials)
            progress.measured(task.task_name, len(candidates), database, mod)
        knobs = len(candidates)
        if trials - knobs >= MIN_METASCHEDULE_TRIALS:
            self._metaschedule(task, trials - knobs, database, progress)
        progress.tasks_tuned += 1
        incumbent = next(iter(records_of(self._shared(), mod, self.target)), None)
        confirmed = self._database(f"confirmed-{progress.tasks_tuned}")
        seconds = self._confirm_faster(mod, database, incumbent, confirmed)
        ran = max(knobs, len(database.get_all_tuning_records()))
        # The ledger counts the allowance: a knob search that ran out of candidates before it searched
        # the whole task, and another run would measure the same ones again.
        merge_into_shared(self.database_dir, confirmed, {workload_key(mod): max(ran, trials)})
        winner = next(iter(confirmed.get_all_tuning_records()), None)
        return TaskTuned(ran, seconds, knobs_of(winner, candidates) if winner is not None else None)

    def _metaschedule(self, task, trials: int, database, progress: Progress) -> None:
        contexts, weights = ms.relax_integration.extracted_tasks_to_tune_contexts([task], work_dir=self.work_dir)
        callbacks = [*ms.measure_callback.MeasureCallback.create("default"), progress.callback(task.task_name)]
        # Each tune_tasks call re-configures MetaSchedule's loggers from this level: warnings only on the console.
        logging.getLogger("tvm.s_tir.meta_schedule").setLevel(logging.WARNING)
        with contextlib.redirect_stdout(sys.stderr):
            ms.tune_tasks(
                tasks=contexts,
                task_weights=weights,
                work_dir=self.work_dir,
                max_trials_global=trials,
                max_trials_per_task=trials,
                num_trials_per_iter=min(16, trials),
                builder=self.builder,
                runner=self.runner,
                database=database,
                measure_callbacks=callbacks,
            )


@dataclass(frozen=True)
class TaskTuned:
    """What tuning one task came to: the trials it ran, the confirmed kernel's seconds and knobs (None
    where none beat the schedule it had; knobs None too where MetaSchedule's candidate won)."""

    trials: int = 0
    seconds: float | None = None
    knobs: dict | None = None


MIN_METASCHEDULE_TRIALS = 16
"""Trials left after the knob search below which MetaSchedule is not started: one batch of its evolutionary
search (16 candidates) is the least that explores its space."""
