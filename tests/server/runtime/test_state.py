"""The bucket lifecycle: every legal move works, every other one is refused."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from compiler.errors import IllegalTransitionError
from server.runtime.models.records import BucketRecord
from server.runtime.models.state import (
    HISTORY_LENGTH,
    LEGAL_MOVES,
    RUN_WINDOW,
    RUNS_TO_TELL,
    BucketState,
    CompileEvent,
    ServedBucket,
    TuningState,
    TuningStatus,
)

ALL_MOVES = list(itertools.product(BucketState, BucketState))


def bucket_in(state: BucketState) -> ServedBucket:
    """A bucket brought to ``state`` through legal moves only."""
    bucket = ServedBucket("x=1x4", {"x": (1, 4)}, "k" * 64)
    path = {
        BucketState.COLD: [],
        BucketState.ADMITTED: [BucketState.ADMITTED],
        BucketState.COMPILING: [BucketState.ADMITTED, BucketState.COMPILING],
        BucketState.READY: [BucketState.ADMITTED, BucketState.COMPILING, BucketState.READY],
        BucketState.FAILED: [BucketState.ADMITTED, BucketState.COMPILING, BucketState.FAILED],
    }[state]
    for step in path:
        bucket.move(step)
    assert bucket.state is state
    return bucket


@pytest.mark.parametrize(("start", "to"), [m for m in ALL_MOVES if m[1] in LEGAL_MOVES[m[0]]])
def test_legal_moves(start, to):
    bucket = bucket_in(start)
    assert bucket.move(to, reason="why") is True
    assert bucket.state is to
    assert bucket.reason == "why"


@pytest.mark.parametrize(("start", "to"), [m for m in ALL_MOVES if m[1] not in LEGAL_MOVES[m[0]]])
def test_illegal_moves_are_refused_and_change_nothing(start, to):
    bucket = bucket_in(start)
    with pytest.raises(IllegalTransitionError, match=f"{start} -> {to}"):
        bucket.move(to)
    assert bucket.state is start


def test_the_table_covers_the_lifecycle():
    legal = {(a, b) for a, targets in LEGAL_MOVES.items() for b in targets}
    assert legal == {
        (BucketState.COLD, BucketState.ADMITTED),
        (BucketState.COLD, BucketState.READY),
        (BucketState.ADMITTED, BucketState.COLD),
        (BucketState.ADMITTED, BucketState.COMPILING),
        (BucketState.COMPILING, BucketState.READY),
        (BucketState.COMPILING, BucketState.FAILED),
        (BucketState.READY, BucketState.READY),
        (BucketState.READY, BucketState.COLD),
        (BucketState.FAILED, BucketState.ADMITTED),  # a retry, after a failure that may pass
    }


def test_a_retry_pending_is_cleared_by_the_retry_or_called_off():
    bucket = bucket_in(BucketState.COMPILING)
    bucket.fail("compile process was killed by SIGKILL", retry_in=30)
    assert bucket.retry_pending and bucket.retry_in == 30
    bucket.move(BucketState.ADMITTED)
    assert not bucket.retry_pending and bucket.retry_in is None
    bucket.move(BucketState.COMPILING)
    bucket.fail("killed again", retry_in=60)
    bucket.stop_retrying("killed again; not retried")
    assert (bucket.state, bucket.reason, bucket.retry_pending) == (
        BucketState.FAILED,
        "killed again; not retried",
        False,
    )


def test_only_from_is_a_compare_and_set():
    bucket = bucket_in(BucketState.ADMITTED)
    assert bucket.move(BucketState.ADMITTED, only_from=BucketState.COLD) is False
    assert bucket.state is BucketState.ADMITTED
    assert bucket.move(BucketState.COMPILING, only_from=BucketState.ADMITTED) is True


def test_one_of_many_racing_threads_wins_the_queue_slot():
    bucket = bucket_in(BucketState.COLD)
    start = threading.Barrier(16)
    wins = []

    def race():
        start.wait()
        wins.append(bucket.move(BucketState.ADMITTED, only_from=BucketState.COLD))

    threads = [threading.Thread(target=race) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wins.count(True) == 1


def test_serve_sets_route_and_latencies_from_new_compiling_or_ready():
    for start in (BucketState.COLD, BucketState.COMPILING, BucketState.READY):
        bucket = bucket_in(start)
        bucket.serve("tvm", {"onnxruntime": 0.123456789, "tvm": 0.05}, compile_seconds=1.5)
        assert (bucket.state, bucket.route, bucket.compile_seconds) == (BucketState.READY, "tvm", 1.5)
        assert bucket.latency_ms == {"onnxruntime": 0.1235, "tvm": 0.05}
        assert bucket.serves_kernel_key == bucket.key
    for start in (BucketState.ADMITTED, BucketState.FAILED):
        with pytest.raises(IllegalTransitionError):
            bucket_in(start).serve("tvm", {})


def test_kernel_key_only_while_ready_on_a_kernel():
    bucket = bucket_in(BucketState.COMPILING)
    assert bucket.serves_kernel_key is None
    bucket.serve("onnxruntime", {})
    assert bucket.serves_kernel_key is None
    bucket.set_tuning(TuningStatus(state=TuningState.DONE, trials=4), tuned_key="t" * 64)
    bucket.serve("tvm-tuned", {})
    assert bucket.serves_kernel_key == "t" * 64


def test_hits_are_not_lost_under_concurrency():
    bucket = bucket_in(BucketState.COLD)

    def hit():
        for _ in range(20_000):
            bucket.traffic.record_hit()

    threads = [threading.Thread(target=hit) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert bucket.traffic.hits == 160_000
    assert bucket.describe()["hits"] == 160_000


def test_tuning_status_leaves_unknown_facts_out_and_old_records_still_load():
    assert TuningStatus(state=TuningState.FAILED, reason="boom").model_dump(mode="json") == {
        "state": "failed",
        "reason": "boom",
    }
    assert TuningStatus(state=TuningState.TUNING, trials=0, seconds=0.0).model_dump(mode="json") == {
        "state": "tuning",
        "trials": 0,
        "seconds": 0.0,
    }
    # Records written before tuning was typed hold {} for "never tuned".
    assert BucketRecord.model_validate({"key": "k", "model_version": 1, "tuning": {}}).tuning is None
    done = BucketRecord.model_validate({"key": "k", "model_version": 1, "tuning": {"state": "done", "trials": 3}})
    assert done.tuning == TuningStatus(state=TuningState.DONE, trials=3)
    with pytest.raises(ValueError):
        BucketRecord.model_validate({"key": "k", "model_version": 1, "tuning": {"state": "bogus"}})


def test_eviction_sends_a_ready_bucket_back_to_cold_and_nothing_else():
    bucket = bucket_in(BucketState.COMPILING)
    bucket.serve("tvm", {"tvm": 1.0})
    assert bucket.evict("cold: evicted") is True
    assert (bucket.state, bucket.route, bucket.reason, bucket.serves_kernel_key) == (
        BucketState.COLD, None, "cold: evicted", None
    )  # fmt: skip
    for start in (BucketState.COLD, BucketState.ADMITTED, BucketState.COMPILING, BucketState.FAILED):
        assert bucket_in(start).evict("no") is False


def test_hits_within_a_sliding_window():
    bucket = bucket_in(BucketState.COLD)
    for at in (0.0, 10.0, 50.0):
        bucket.traffic.record_hit(at, window=60)
    assert bucket.traffic.hits_within(60, 59.0, 3) is True
    assert bucket.traffic.hits_within(60, 61.0, 3) is False  # the first hit left the window
    assert bucket.traffic.hits_within(60, 61.0, 2) is True
    assert bucket.traffic.hits_within(60, 59.0, 4) is False


def test_traffic_decays_with_the_window():
    busy, quiet = bucket_in(BucketState.COLD), bucket_in(BucketState.COLD)
    for at in range(10):
        busy.traffic.record_hit(float(at), window=60)
    quiet.traffic.record_hit(9.0, window=60)
    assert busy.traffic.heat(9.0) > 8 and quiet.traffic.heat(9.0) == 1.0
    assert busy.traffic.heat(9.0 + 60) == pytest.approx(busy.traffic.heat(9.0) / 2.718281828, rel=1e-6)
    assert busy.traffic.heat(600.0) < quiet.traffic.heat(9.0)


def test_peak_concurrency_counts_requests_running_at_once_and_failed_runs_end_too():
    bucket = bucket_in(BucketState.COLD)
    bucket.begin_run()
    bucket.observe_run(1.0)
    assert bucket.peak_concurrency == 1
    for _ in range(3):
        bucket.begin_run()
    bucket.observe_run(None)  # a run that raised
    bucket.observe_run(1.0)
    bucket.begin_run()
    assert bucket.peak_concurrency == 3
    bucket.observe_run(1.0)
    bucket.observe_run(1.0)
    bucket.begin_run()
    bucket.observe_run(1.0)
    assert bucket.peak_concurrency == 3 and bucket.describe()["peak_concurrency"] == 3


def test_the_inline_decision_reads_the_fastest_recent_run_not_the_waits_for_the_gil():
    tiny = bucket_in(BucketState.COLD)
    for _ in range(RUNS_TO_TELL - 1):
        tiny.observe_run(0.01)
    assert not tiny.runs_below(0.1)  # not enough runs to tell
    tiny.observe_run(0.01)
    assert tiny.runs_below(0.1)
    for _ in range(RUN_WINDOW - 1):  # runs on a busy pool: each waited up to 5 ms for the GIL
        tiny.observe_run(5.0)
    assert tiny.runs_below(0.1)
    tiny.observe_run(5.0)  # the window holds no fast run any more: its engine has become slow
    assert not tiny.runs_below(0.1)
    slow = bucket_in(BucketState.COLD)
    for _ in range(RUN_WINDOW):
        slow.observe_run(0.4)
    assert not slow.runs_below(0.1) and slow.runs_below(0.5)
    slow.observe_run(None)  # a failed run says nothing of the engine's cost
    assert slow.runs_below(0.5)


def test_a_route_says_whether_latency_or_throughput_chose_it():
    bucket = bucket_in(BucketState.COMPILING)
    bucket.serve("tvm", {"onnxruntime": 1.0, "tvm": 0.5})
    assert bucket.describe()["routed_by"] == "latency" and bucket.throughput_rps == {}
    bucket.serve(
        "onnxruntime", {"onnxruntime": 1.0, "tvm": 0.5}, throughput_rps={"onnxruntime": 1900.04, "tvm": 1500.0}
    )
    described = bucket.describe()
    assert described["routed_by"] == "throughput"
    assert described["throughput_rps"] == {"onnxruntime": 1900.0, "tvm": 1500.0}


def _compile(reason: str, **facts) -> CompileEvent:
    base = {"model version": 1, "graph": "g1", "target": "llvm", "TVM": "0.27", "compiler version": "9"}
    base["tuning"] = "null"
    return CompileEvent(at=time.time(), reason=reason, key=reason, facts=base | facts, compile_seconds=1.0)


def test_each_compile_names_what_changed_in_its_key_and_the_record_keeps_the_last_few():
    bucket = ServedBucket("x=1x4", {"x": (1, 4)}, "k" * 64)
    assert bucket.add_compile(_compile("first_compile")).changed == []
    new_version = bucket.add_compile(_compile("new_model_version", **{"model version": 2, "graph": "g2"}))
    assert new_version.changed == ["model version", "graph"]
    upgraded = _compile("target_or_compiler_changed", **{"model version": 2, "graph": "g2", "compiler version": "10"})
    assert bucket.add_compile(upgraded).changed == ["compiler version"]
    tuned = _compile("tuned", **{"model version": 2, "graph": "g2", "compiler version": "10", "tuning": "[64, 16]"})
    assert bucket.add_compile(tuned).changed == ["tuning"]
    for _ in range(HISTORY_LENGTH):
        bucket.add_compile(tuned)
    assert len(bucket.history) == HISTORY_LENGTH and bucket.history[-1].changed == []
    # Through the record, as a restart reads it back.
    record = BucketRecord(key="k" * 64, model_version=2, history=bucket.history)
    again = ServedBucket("x=1x4", {"x": (1, 4)}, "k" * 64, history=BucketRecord.model_validate_json(
        record.model_dump_json()).history)  # fmt: skip
    assert again.history == bucket.history
