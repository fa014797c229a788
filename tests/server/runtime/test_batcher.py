"""The dynamic batcher's queue state (no threads), its owner thread with a plain function as the
run, and which models may batch."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest
from pydantic import ValidationError

from compiler.models.signature import Signature, TensorSpec
from compiler.shapes.buckets import AxisPolicy, AxisSafety
from server.runtime.observability.metrics import Metrics
from server.runtime.serving.batcher import BatchQueue, DynamicBatcher, DynamicBatching, Waiting, find_batch_axis


def waiting(name: str, rows: int = 1, group: str = "g", at: float = 0.0) -> Waiting:
    return Waiting(name, group, rows, at)


def names(batch: list[Waiting] | None) -> list[str] | None:
    return None if batch is None else [w.item for w in batch]


def test_a_group_goes_at_a_preferred_size_or_when_full_or_late():
    q = BatchQueue(max_batch_size=8, max_delay_s=0.01, preferred={1, 2, 4, 8})
    q.add(waiting("a", rows=3))
    assert q.take(now=0.0) is None  # 3 rows: not preferred, not full, not late
    assert q.deadline() == pytest.approx(0.01)
    q.add(waiting("b", rows=1))
    assert names(q.take(now=0.0)) == ["a", "b"]  # 4 rows: preferred
    q.add(waiting("c", rows=3, at=0.001))  # close behind the others: company is due
    assert q.take(now=0.0109) is None
    assert names(q.take(now=0.011)) == ["c"]  # waited the delay
    assert len(q) == 0 and q.deadline() is None


def test_the_window_closes_while_requests_arrive_further_apart_than_it():
    q = BatchQueue(max_batch_size=8, max_delay_s=0.01, preferred={8})
    for i in range(10):  # one request every 50 ms: none would find company within 10 ms
        q.add(waiting(f"slow{i}", at=i * 0.05))
        if i >= 3:  # once the gaps are known, a lone request goes at once
            assert names(q.take(now=i * 0.05)) == [f"slow{i}"]
        else:
            q.take(now=i * 0.05 + 0.01)
    assert q.delay_s == 0.0

    q = BatchQueue(max_batch_size=8, max_delay_s=0.01, preferred={8})
    for i in range(5):  # 1 ms apart: company is due, the window stays open
        q.add(waiting(f"fast{i}", at=i * 0.001))
    assert q.delay_s == 0.01
    assert q.take(now=0.005) is None
    assert names(q.take(now=0.01)) == [f"fast{i}" for i in range(5)]


def test_a_batch_never_passes_the_maximum_and_keeps_arrival_order():
    q = BatchQueue(max_batch_size=8, max_delay_s=1.0, preferred=set())
    for name, rows in (("a", 3), ("b", 4), ("c", 2), ("d", 1)):
        q.add(waiting(name, rows=rows))
    assert names(q.take(now=0.0)) == ["a", "b"]  # c would make 9: the group cannot grow, it goes
    assert q.take(now=0.0) is None  # c, d: 3 rows wait
    assert names(q.take(now=0.0, flush=True)) == ["c", "d"]


def test_free_instances_share_a_going_group():
    q = BatchQueue(max_batch_size=8, max_delay_s=1.0, preferred={1, 2, 4, 8})
    for name in "abcdefg":
        q.add(waiting(name))
    assert q.take(now=0.0, instances=2) is None  # 7 rows: not preferred, not late: the group waits
    # Late: it goes, and with two idle instances this batch takes its share (4), the other the rest.
    assert names(q.take(now=1.0, instances=2)) == ["a", "b", "c", "d"]
    assert names(q.take(now=1.0)) == ["e", "f", "g"]

    q = BatchQueue(max_batch_size=8, max_delay_s=1.0, preferred={8})
    for name in "abcdefgh":
        q.add(waiting(name))
    # A share of 4 rounds up to the preferred 8: a preferred batch is never split.
    assert names(q.take(now=0.0, instances=2)) == list("abcdefgh")


def test_a_request_larger_than_the_maximum_runs_alone():
    q = BatchQueue(max_batch_size=4, max_delay_s=1.0, preferred=set())
    q.add(waiting("big", rows=9))
    q.add(waiting("small", rows=1))
    assert names(q.take(now=0.0)) == ["big"]


def test_groups_are_never_mixed_and_the_oldest_ready_goes_first():
    q = BatchQueue(max_batch_size=8, max_delay_s=1.0, preferred={2})
    q.add(waiting("x1", group="x", at=0.0))
    q.add(waiting("y1", group="y", at=0.1))
    q.add(waiting("y2", group="y", at=0.2))
    assert names(q.take(now=0.3)) == ["y1", "y2"]  # x alone is 1 row: not preferred
    assert q.take(now=0.3) is None
    assert names(q.take(now=1.0)) == ["x1"]


def test_preferred_sizes_default_to_the_batch_buckets():
    config = DynamicBatching(max_batch_size=8)
    assert config.preferred(AxisPolicy(kind="pow2", min=1, max=64)) == {1, 2, 4, 8}
    assert config.preferred(AxisPolicy(kind="list", sizes=[4, 6, 32])) == {4, 6}
    assert DynamicBatching(max_batch_size=8, preferred_batch_sizes=[8, 4, 4]).preferred_batch_sizes == [4, 8]
    with pytest.raises(ValidationError):
        DynamicBatching(max_batch_size=4, preferred_batch_sizes=[8])
    with pytest.raises(ValidationError):
        DynamicBatching(max_batch_size=0)


def spec(name: str, *dims) -> TensorSpec:
    return TensorSpec(name, "float32", tuple(dims))


def test_the_batch_axis_is_dim_0_everywhere_and_verified_padding_safe():
    signature = Signature((spec("a", "batch", 4), spec("b", "batch", 2)), (spec("y", "n", 3),))
    safe = AxisSafety(axis="batch", safe=True, reason="ok", output_axes={"y": [0]})
    assert find_batch_axis(signature, {"batch": safe})[0] == "batch"

    unsafe = AxisSafety(axis="batch", safe=False, reason="padding changes the outputs")
    assert find_batch_axis(signature, {"batch": unsafe}) == (
        None,
        "axis 'batch' is not verified padding-safe: padding changes the outputs",
    )
    no_output = AxisSafety(axis="batch", safe=True, reason="ok", output_axes={})
    assert find_batch_axis(signature, {"batch": no_output})[1] == "dim 0 of output 'y' does not follow axis 'batch'"
    split = Signature((spec("a", "batch", 4), spec("b", "other", 2)), (spec("y", "n", 3),))
    assert find_batch_axis(split, {"batch": safe}) == (None, "dim 0 of the inputs is not one shared symbolic axis")
    static = Signature((spec("a", 1, "seq"),), (spec("y", 1),))
    assert find_batch_axis(static, {})[0] is None


class Recorder:
    """A run that remembers its batches and takes ``seconds``."""

    def __init__(self, seconds: float = 0.0, fail: str | None = None) -> None:
        self.seconds, self.fail = seconds, fail
        self.batches: list[list[str]] = []
        self.started = threading.Event()

    def __call__(self, items: list[str]) -> list:
        self.started.set()
        self.batches.append(list(items))
        time.sleep(self.seconds)
        return [ValueError(item) if item == self.fail else item.upper() for item in items]


POOL = concurrent.futures.ThreadPoolExecutor(2)


def batcher(run, instances: int = 1, **config) -> DynamicBatcher:
    config = DynamicBatching(**config)
    preferred = set(config.preferred_batch_sizes or [])
    return DynamicBatcher("m", config, preferred, run, Metrics(), instances=instances, executor=POOL)


def test_a_lone_request_waits_the_delay_and_no_longer():
    run = Recorder()
    owner = batcher(run, max_batch_size=4, max_queue_delay_us=200_000, preferred_batch_sizes=[4])
    started = time.monotonic()
    assert owner.submit("a", group="g", rows=1).result(timeout=5) == "A"
    waited = time.monotonic() - started
    assert 0.2 <= waited < 1.0, waited
    owner.close()
    owner.join(5)


def test_requests_arriving_during_a_run_wait_for_it_and_then_go_together():
    run = Recorder(seconds=0.3)
    owner = batcher(run, max_batch_size=8, max_queue_delay_us=50_000, preferred_batch_sizes=[8])
    first = owner.submit("a", group="g", rows=1)
    assert run.started.wait(5)  # "a" runs alone after the delay
    started = time.monotonic()
    later = [owner.submit(name, group="g", rows=1) for name in "bcd"]
    assert [f.result(timeout=5) for f in later] == ["B", "C", "D"]
    # They waited for the running batch (0.3 s), not for a full batch: delay + one run at most.
    assert time.monotonic() - started < 0.05 + 0.3 + 0.5
    assert first.result() == "A"
    assert run.batches == [["a"], ["b", "c", "d"]]
    owner.close()
    owner.join(5)


def test_a_failing_request_fails_alone_and_closing_runs_what_is_queued():
    run = Recorder(fail="b")
    owner = batcher(run, max_batch_size=8, max_queue_delay_us=10_000_000, preferred_batch_sizes=[8])
    futures = {name: owner.submit(name, group="g", rows=1) for name in "abc"}
    owner.close()  # nothing reached 8 rows or the 10 s delay: closing sends them
    owner.join(5)
    assert futures["a"].result(timeout=1) == "A" and futures["c"].result(timeout=1) == "C"
    with pytest.raises(ValueError, match="b"):
        futures["b"].result(timeout=1)
    with pytest.raises(RuntimeError):
        owner.submit("late", group="g", rows=1)


def test_a_cancelled_request_is_skipped():
    run = Recorder()
    owner = batcher(run, max_batch_size=2, max_queue_delay_us=10_000_000, preferred_batch_sizes=[2])
    gone = owner.submit("a", group="g", rows=1)
    assert gone.cancel()
    kept = owner.submit("b", group="g", rows=1)
    assert kept.result(timeout=5) == "B"
    owner.close()
    owner.join(5)


def test_each_free_instance_takes_a_batch():
    run = Recorder(seconds=0.3)
    owner = batcher(run, instances=2, max_batch_size=8, max_queue_delay_us=0)
    started = time.monotonic()
    first = owner.submit("a", group="g", rows=1)
    assert run.started.wait(5)
    second = owner.submit("b", group="g", rows=1)  # the second instance is free: no waiting for the first
    assert (first.result(timeout=5), second.result(timeout=5)) == ("A", "B")
    assert time.monotonic() - started < 0.3 + 0.25
    assert run.batches == [["a"], ["b"]]
    owner.close()
    owner.join(5)
