"""Whether batching pays, per group: judged from the batch-1 and batched buckets' recent runs, off where a
batched row costs no less than a lone request, measured again later, and said why."""

from __future__ import annotations

import onnx
import pytest

from compiler.models.signature import read_signature
from compiler.shapes.buckets import AxisPolicy, AxisSafety, BucketPlanner, bucket_label
from server.runtime.models.state import RUN_WINDOW, RUNS_TO_TELL, ServedBucket
from server.runtime.serving import batch_verdicts
from server.runtime.serving.batch_verdicts import BatchVerdicts
from tests import synthetic


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    """The verdicts' clock, moved by the test."""
    now = [1000.0]
    monkeypatch.setattr(batch_verdicts.time, "monotonic", lambda: now[0])
    return now


@pytest.fixture
def planned():
    signature = read_signature(onnx.load_from_string(synthetic.relu_model(["batch", "seq"])))
    safe = AxisSafety(axis="batch", safe=True, reason="test", output_axes={"y": [0]})
    planner = BucketPlanner(signature, {"batch": AxisPolicy(kind="pow2", min=1, max=8)}, {"batch": safe})
    buckets: dict[str, ServedBucket] = {}

    def serve(rows: int, ms: float) -> None:
        """``RUNS_TO_TELL`` runs of the bucket of ``rows`` rows (seq 5), each ``ms`` long."""
        bucket = planner.plan({"x": (rows, 5)}).bucket
        label = bucket_label(bucket)
        served = buckets.setdefault(label, ServedBucket(label, bucket, "k" * 64))
        for _ in range(RUNS_TO_TELL):
            served.begin_run()
            served.observe_run(ms)

    verdicts = BatchVerdicts(planner, lambda bucket: buckets.get(bucket_label(bucket)), {1, 2, 4, 8}, inline_max_ms=0.1)
    return planner, serve, verdicts


def test_a_group_batches_until_measured_and_while_rows_get_cheaper(planned, clock):
    planner, serve, verdicts = planned
    plan = planner.plan({"x": (1, 5)})
    group = ("seq", 5)
    assert verdicts.batches(group, plan)  # nothing measured: on, to measure
    assert "not measured" in verdicts.describe()[0]["reason"]
    serve(1, 1.0)
    serve(8, 4.0)  # half a millisecond a row
    assert "not measured" in verdicts.describe()[0]["reason"]  # a verdict holds for a second
    clock[0] += batch_verdicts.REJUDGE_SECONDS
    assert verdicts.batches(group, plan)
    (described,) = verdicts.describe()
    assert described == {
        "bucket": "x=1x5",
        "batches": True,
        "reason": "on: a row of a 8-row batch runs in 0.500 ms, a request alone in 1.000 ms",
    }


def test_a_group_whose_rows_get_no_cheaper_skips_the_batcher_then_is_measured_again(planned, clock):
    planner, serve, verdicts = planned
    plan = planner.plan({"x": (1, 5)})
    group = ("seq", 5)
    serve(1, 1.0)
    serve(8, 8.4)  # a batched row costs more than a request alone
    assert not verdicts.batches(group, plan)
    (described,) = verdicts.describe()
    assert described["reason"].startswith("off: rows get no cheaper (a row of a 8-row batch runs in 1.050 ms")
    # Past the retry time the group batches again for a moment, so that its batched runs are measured anew.
    clock[0] += batch_verdicts.RETRY_SECONDS + batch_verdicts.REJUDGE_SECONDS
    assert verdicts.batches(group, plan)
    assert verdicts.describe()[0]["reason"].startswith("on: measuring again")
    serve(8, 4.0)  # the batch bucket's new engine is faster
    clock[0] += batch_verdicts.REJUDGE_SECONDS
    assert verdicts.batches(group, plan)
    assert verdicts.describe()[0]["reason"].startswith("on: a row of a 8-row batch runs in 0.500 ms")


def test_a_group_whose_requests_run_in_less_than_a_hop_to_a_thread_skips_the_batcher(planned, clock):
    """A tiny model's rows get cheaper in a batch, but the batcher's hop to a thread and back costs more than
    the run: its requests run on the event loop instead, for as long as they stay that fast."""
    planner, serve, verdicts = planned
    plan = planner.plan({"x": (1, 5)})
    group = ("seq", 5)
    serve(1, 0.03)
    serve(8, 0.04)
    assert not verdicts.batches(group, plan)
    assert (
        verdicts.describe()[0]["reason"]
        == "off: a request alone runs in 0.030 ms, under the 0.1 ms of a hop to a thread"
    )
    for _ in range(RUN_WINDOW // RUNS_TO_TELL):  # slower now (another engine), over the whole run window
        serve(1, 0.5)  # batched again at the next verdict, no retry wait
    clock[0] += batch_verdicts.REJUDGE_SECONDS
    assert verdicts.batches(group, plan)
    assert verdicts.describe()[0]["reason"].startswith("on: a row of a 8-row batch runs in 0.005 ms")
