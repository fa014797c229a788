"""The order tuning spends its trials in: the kernels that lose most to ONNX Runtime first."""

from __future__ import annotations

from compiler.measuring.tuning_plan import TaskCost, confirmed_winner, kernel_times, plan_tuning


def _trials(planned) -> dict[str, int]:
    return {step.task.name: step.trials for step in planned}


def test_trials_go_to_the_kernels_that_lose_most_not_to_the_first_extracted():
    tasks = [
        # extraction order: a cheap kernel first, as MetaSchedule's round-robin warm-up would start with it
        TaskCost("layer_norm", calls=25, seconds=0.0001, profiled_ms=2.0, ort_ms=6.0),
        TaskCost("fused_matmul_add", calls=12, seconds=0.005, profiled_ms=60.0, ort_ms=40.0),  # 1.5x ORT
        TaskCost("matmul", calls=36, seconds=0.0015, profiled_ms=54.0, ort_ms=54.0),  # on par
        TaskCost("softmax", calls=12, seconds=0.0002, profiled_ms=3.0, ort_ms=1.0),  # 3x, but small
    ]
    planned = plan_tuning(tasks, trials=40, trials_per_task=16)

    assert [step.task.name for step in planned] == ["fused_matmul_add", "matmul", "softmax", "layer_norm"]
    assert _trials(planned) == {"fused_matmul_add": 16, "matmul": 16, "softmax": 8, "layer_norm": 0}
    assert planned[-1].reason == "budget spent on tasks that lose more"
    first = planned[0].as_dict()
    assert first["ratio_vs_ort"] == 1.5 and abs(first["share"] - 60 / 119) < 1e-3


def test_a_kernel_faster_than_onnx_runtime_waits_behind_a_smaller_one_that_loses():
    tasks = [
        TaskCost("big_but_winning", calls=1, seconds=0.01, profiled_ms=10.0, ort_ms=20.0),  # share 0.67 x 0.5
        TaskCost("small_but_losing", calls=1, seconds=0.005, profiled_ms=5.0, ort_ms=2.0),  # share 0.33 x 2.5
    ]
    assert [step.task.name for step in plan_tuning(tasks, 16, 16)] == ["small_but_losing", "big_but_winning"]


def test_without_a_profile_tasks_rank_by_their_measured_share_of_the_run():
    tasks = [
        TaskCost("once_slow", calls=1, seconds=0.003),
        TaskCost("often_quick", calls=12, seconds=0.001),
        TaskCost("negligible", calls=1, seconds=0.00001),
    ]
    planned = plan_tuning(tasks, trials=64, trials_per_task=16)
    assert [step.task.name for step in planned] == ["often_quick", "once_slow", "negligible"]
    assert _trials(planned) == {"often_quick": 16, "once_slow": 16, "negligible": 0}
    assert planned[-1].reason.startswith("under 0.5%")


def test_a_workload_tuned_before_by_any_bucket_is_not_tuned_again_and_a_partial_one_gets_the_rest():
    tasks = [
        TaskCost("shared_with_another_model", calls=12, seconds=0.005, tuned_trials=17),
        TaskCost("half_done", calls=12, seconds=0.004, tuned_trials=10),
        TaskCost("new", calls=12, seconds=0.003),
    ]
    planned = plan_tuning(tasks, trials=64, trials_per_task=16)
    assert _trials(planned) == {"shared_with_another_model": 0, "half_done": 6, "new": 16}
    assert planned[0].reason == "tuned before (shared database)"


def test_an_explain_profiles_kernel_rows_become_the_ranking_input():
    profile = {"kernels": [{"kernel": "fused_matmul_add", "tvm_ms": 5.0, "ort_ms": 4.0}, {"kernel": "reshape"}]}
    assert kernel_times(profile) == {"fused_matmul_add": (5.0, 4.0), "reshape": (None, None)}
    assert kernel_times(None) == {}


def test_a_tuned_candidate_replaces_a_schedule_only_when_it_beats_it_side_by_side_by_the_margin():
    # Re-timed against the default schedule's 5.0 ms: 4.9 is within noise, 4.5 is a win, the fastest wins.
    assert confirmed_winner(0.0050, {1: 0.0049, 2: 0.0052}) is None
    assert confirmed_winner(0.0050, {1: 0.0049, 2: 0.0045, 3: 0.0047}) == 2
    # Nothing to replace yet (no default schedule on this target): the fastest candidate.
    assert confirmed_winner(None, {1: 0.0049, 2: 0.0052}) == 1
    assert confirmed_winner(0.0050, {}) is None
