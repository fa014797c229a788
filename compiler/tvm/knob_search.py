"""Tuning over the rules' own choices: one task's candidates are its default schedule with one knob turned
(:mod:`.schedules.knobs`), measured on the real workload; then the knobs that won, together.

The rules' design space is small (a few knobs, a few values each) and every point of it is a schedule the
rules already know how to make well, so a few dozen measurements find what MetaSchedule's generic space
rarely does in hundreds. The default schedule is always among the candidates, and a candidate replaces
the schedule a compile applies now only where re-timed side by side it beats it
(``TuningRun._confirm_faster``): tuning can only help.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm_ffi
from tvm import s_tir
from tvm.s_tir import meta_schedule as ms

from .schedules import default_cpu_rules
from .schedules.knobs import Knob, knob_session


@dataclass
class KnobCandidate:
    """One schedule of a task: the knobs it turned (none: the rules' default) and its schedule."""

    overrides: dict[str, Knob]
    schedule: s_tir.Schedule
    seconds: float | None = None


def schedule_with(func, target, overrides: dict[str, Knob]) -> tuple[s_tir.Schedule | None, set[str], dict]:
    """The first default rule's schedule of ``func`` under ``overrides``; the knobs it applied and those it
    offered."""
    with knob_session(overrides) as session:
        for rule in default_cpu_rules():
            sch = rule.apply(func, target, False)
            if sch is not None:
                return sch, session.used, session.offered
    return None, set(), session.offered


def knob_candidates(func, target, limit: int) -> list[KnobCandidate]:
    """The default schedule, then one candidate per alternative of each knob the rules offered for ``func``
    (at most ``limit`` in all); schedules that come out the same as one before are left out."""
    default, _, offered = schedule_with(func, target, {})
    if default is None:
        return []
    candidates = [KnobCandidate({}, default)]
    seen = {tvm_ffi.structural_hash(default.mod)}
    for name, (_, alternatives) in offered.items():
        for value in alternatives:
            if len(candidates) >= limit:
                return candidates
            sch, used, _ = schedule_with(func, target, {name: value})
            if sch is None or name not in used:  # declined, or the knob was not reached this time
                continue
            digest = tvm_ffi.structural_hash(sch.mod)
            if digest not in seen:
                seen.add(digest)
                candidates.append(KnobCandidate({name: value}, sch))
    return candidates


def combined_candidate(func, target, measured: list[KnobCandidate]) -> KnobCandidate | None:
    """The knobs of every single-knob candidate that beat the default, turned together; None where fewer
    than two did (or the rules decline the combination)."""
    default = measured[0].seconds
    if default is None:
        return None
    winners = sorted(
        (c for c in measured[1:] if c.seconds is not None and c.seconds < default), key=lambda c: c.seconds
    )
    overrides: dict[str, Knob] = {}
    for candidate in winners:  # the fastest first: of two values of one knob, its value stays
        for name, value in candidate.overrides.items():
            overrides.setdefault(name, value)
    if len(overrides) < 2:
        return None
    sch, used, _ = schedule_with(func, target, overrides)
    return KnobCandidate(overrides, sch) if sch is not None and len(used) >= 2 else None


def measure(candidates: list[KnobCandidate], target, builder, runner) -> None:
    """Each candidate's seconds per call, with the tuning runner (None where it did not build or run)."""
    if not candidates:
        return
    args = ms.arg_info.ArgInfo.from_prim_func(candidates[0].schedule.mod["main"])
    built = builder.build([ms.builder.BuilderInput(c.schedule.mod, target) for c in candidates])
    runnable = [(c, b) for c, b in zip(candidates, built, strict=True) if b.error_msg is None]
    futures = runner.run([ms.runner.RunnerInput(b.artifact_path, "cpu", args) for _, b in runnable])
    for (candidate, _), future in zip(runnable, futures, strict=True):
        result = future.result()
        if result.error_msg is None and result.run_secs:
            candidate.seconds = sum(float(s) for s in result.run_secs) / len(result.run_secs)


def search_knobs(mod, target, builder, runner, database, *, limit: int) -> list[KnobCandidate]:
    """Measure ``mod``'s knob candidates (the combination of the winners too) and commit each into
    ``database`` as a tuning record; returns them, measured."""
    func = mod["main"]
    candidates = knob_candidates(func, target, limit)
    measure(candidates, target, builder, runner)
    combined = combined_candidate(func, target, candidates) if len(candidates) < limit else None
    if combined is not None:
        measure([combined], target, builder, runner)
        candidates.append(combined)
    args = ms.arg_info.ArgInfo.from_prim_func(func)
    workload = database.commit_workload(mod)
    for candidate in candidates:
        if candidate.seconds is not None:
            record = ms.database.TuningRecord(candidate.schedule.trace, workload, [candidate.seconds], target, args)
            database.commit_tuning_record(record)
    return candidates


def knobs_of(record, candidates: list[KnobCandidate]) -> dict[str, Knob] | None:
    """The knobs of the candidate whose schedule ``record`` holds; None where none does (MetaSchedule's)."""
    trace = str(record.trace)
    return next((c.overrides for c in candidates if str(c.schedule.trace) == trace), None)
