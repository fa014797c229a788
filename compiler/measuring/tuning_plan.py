"""Which kernels a tuning run spends its trials on, in what order: those that lose most first.

MetaSchedule's own task scheduler warms up round-robin over every task (three
rounds of a batch each before its gradient picks one), so a budget of 64
trials over BERT-base's 19 tasks went to the first four tasks in extraction
order, whatever they cost. Here each task is ranked by what it loses: its
share of the untuned run times its ratio against ONNX Runtime on the same
nodes (the bucket's explain profile), or its share alone where ONNX Runtime's
time is not known. Trials go down that ranking, a task's full allowance
each, until the budget is spent. A workload the shared database already
holds tuned (from any bucket or model) is not tuned again.
"""

from __future__ import annotations

from dataclasses import dataclass

CONFIRM_MARGIN = 0.03
"""A tuned candidate must be this much faster than the schedule it replaces, re-timed side by side."""
BUDGET_SPENT = "budget spent on tasks that lose more"
"""The reason of a task planned no trials only because those before it took the budget: a run whose tasks
spend less than their allowance (a knob search ends when its candidates do) goes on down the ranking."""
MIN_SHARE = 0.005
"""A task under this share of the run is never tuned: even a kernel twice as fast would not show."""


@dataclass(frozen=True)
class TaskCost:
    """One tuning task (a kernel, or several with one workload) and what it costs the bucket's run."""

    name: str
    calls: int
    """How often one run calls it (MetaSchedule's task weight)."""
    seconds: float
    """One call with its default schedule, measured by the tuning runner."""
    profiled_ms: float | None = None
    """Its kernels' milliseconds per run in the bucket's explain profile."""
    ort_ms: float | None = None
    """ONNX Runtime's milliseconds per run on the same nodes."""
    tuned_trials: int = 0
    """Trials the shared database already holds for its workload."""

    @property
    def run_ms(self) -> float:
        return self.profiled_ms if self.profiled_ms is not None else self.seconds * self.calls * 1000

    @property
    def ratio(self) -> float | None:
        """Its time over ONNX Runtime's on the same nodes; None where either is not known."""
        if self.profiled_ms and self.ort_ms:
            return self.profiled_ms / self.ort_ms
        return None


@dataclass(frozen=True)
class PlannedTask:
    task: TaskCost
    share: float
    """Of the untuned run's kernel time."""
    priority: float
    """share x ratio against ONNX Runtime (share alone where the ratio is not known)."""
    trials: int
    """Trials it is given (0: not tuned this run; ``reason`` says why)."""
    reason: str | None = None

    def as_dict(self) -> dict:
        ratio = self.task.ratio
        return {
            "kernel": self.task.name,
            "calls": self.task.calls,
            "share": round(self.share, 4),
            "ratio_vs_ort": round(ratio, 2) if ratio is not None else None,
            "priority": round(self.priority, 4),
            "trials": self.trials,
            "reason": self.reason,
        }


def plan_tuning(tasks: list[TaskCost], trials: int, trials_per_task: int) -> list[PlannedTask]:
    """Every task ranked by priority (highest first) with the trials it gets out of ``trials``."""
    total_ms = sum(task.run_ms for task in tasks) or 1.0
    ranked = []
    for task in tasks:
        share = task.run_ms / total_ms
        ratio = task.ratio
        ranked.append((task, share, share * (ratio if ratio is not None else 1.0)))
    ranked.sort(key=lambda entry: (-entry[2], entry[0].name))
    left = trials
    planned = []
    for task, share, priority in ranked:
        wanted = trials_per_task - task.tuned_trials
        if wanted <= 0:
            planned.append(PlannedTask(task, share, priority, 0, "tuned before (shared database)"))
        elif share < MIN_SHARE:
            planned.append(PlannedTask(task, share, priority, 0, f"under {MIN_SHARE:.1%} of the run"))
        elif left <= 0:
            planned.append(PlannedTask(task, share, priority, 0, BUDGET_SPENT))
        else:
            given = min(wanted, left)
            left -= given
            planned.append(PlannedTask(task, share, priority, given))
    return planned


def kernel_times(profile: dict | None) -> dict[str, tuple[float | None, float | None]]:
    """An explain profile's kernels: name -> (its ms per run, ONNX Runtime's ms on the same nodes)."""
    if not profile:
        return {}
    return {row["kernel"]: (row.get("tvm_ms"), row.get("ort_ms")) for row in profile.get("kernels", [])}


def confirmed_winner(incumbent: float | None, candidates: dict[int, float]) -> int | None:
    """Of tuned candidates re-timed side by side with the schedule a compile applies now (``incumbent``
    seconds; None where there is none), the one to replace it: the fastest, where it beats the incumbent
    by ``CONFIRM_MARGIN``; None where none does."""
    if not candidates:
        return None
    fastest = min(candidates, key=candidates.get)
    if incumbent is not None and candidates[fastest] > incumbent * (1 - CONFIRM_MARGIN):
        return None
    return fastest
