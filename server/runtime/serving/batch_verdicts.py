"""Whether batching pays, per group of a batching model (requests that land in the same bucket on every axis
but the batch's): it does where a row of the group's batches runs in less time than a request run alone,
for the engines serving those buckets now. Where it does not, the group's requests skip the batcher's queue
and its join and split. A group is judged from its buckets' recent runs (the fastest of the last few: a
run's wall time also holds waits for Python's GIL), and judged again every :data:`RETRY_SECONDS` with the
batcher on, so that an engine that changes (a kernel routed, a faster batch bucket) is seen."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from compiler.shapes.buckets import Bucket, BucketPlan, BucketPlanner, bucket_label

from ..models.state import ServedBucket

ROW_SHARE = 1.0
"""Batching stays on for a group while a batched row runs in under this share of a lone request's run."""

RETRY_SECONDS = 30.0
"""How long a group that batching does not pay for skips the batcher before it is measured again."""

REJUDGE_SECONDS = 1.0
"""How long a verdict is reused before the buckets' recent runs are read again."""


@dataclass(frozen=True)
class Verdict:
    batches: bool
    reason: str
    """Why, with the figures: a batched row's run against a lone request's."""
    judged: float = 0.0
    off_since: float | None = None

    def describe(self, bucket: str) -> dict:
        return {"bucket": bucket, "batches": self.batches, "reason": self.reason}


class BatchVerdicts:
    """One batching model's verdicts, by group."""

    def __init__(
        self,
        planner: BucketPlanner,
        find_bucket: Callable[[Bucket], ServedBucket | None],
        preferred: set[int],
        *,
        inline_max_ms: float = 0.0,
    ) -> None:
        """``find_bucket``: the model's served bucket of a bucket, where it has been served; ``inline_max_ms``:
        requests whose runs take less run on the event loop, not worth the batcher's hop to a thread."""
        self.planner = planner
        self.inline_max_ms = inline_max_ms
        self.find_bucket = find_bucket
        self.sizes = sorted(size for size in preferred if size > 1)
        self._verdicts: dict[Hashable, tuple[str, Verdict]] = {}
        self._lock = threading.Lock()

    def batches(self, group: Hashable, plan: BucketPlan) -> bool:
        """Whether a request of ``group`` (its plan ``plan``) goes through the batcher."""
        now = time.monotonic()
        with self._lock:
            label, verdict = self._verdicts.get(group, (None, None))
        if verdict is None or now - verdict.judged >= REJUDGE_SECONDS:
            label, verdict = self._judge(plan, verdict, now)
            with self._lock:
                self._verdicts[group] = (label, verdict)
        return verdict.batches

    def describe(self) -> list[dict]:
        with self._lock:
            return [verdict.describe(label) for label, verdict in self._verdicts.values()]

    def _judge(self, plan: BucketPlan, previous: Verdict | None, now: float) -> tuple[str, Verdict]:
        alone_bucket = self._bucket(plan, 1)
        label = alone_bucket.label if alone_bucket is not None else bucket_label(plan.bucket)
        if previous is not None and previous.off_since is not None:
            if now - previous.off_since < RETRY_SECONDS:
                return label, Verdict(False, previous.reason, now, previous.off_since)
            # Batched again for a second, so that the batched buckets' recent runs are today's.
            return label, Verdict(True, f"on: measuring again ({previous.reason})", judged=now)
        alone = alone_bucket.recent_floor_ms() if alone_bucket is not None else None
        if alone_bucket is not None and alone_bucket.runs_below(self.inline_max_ms):
            # The batcher hands a request to a thread and back, which costs more than the whole run (the
            # demo model at 8 in flight: 0.77x the throughput unbatched). Judged again each second: while
            # off, its runs go on being measured.
            fastest = alone_bucket.run_floor_ms
            return label, Verdict(False, f"off: a request alone runs in {fastest:.3f} ms, under the "
                                         f"{self.inline_max_ms:g} ms of a hop to a thread", now)  # fmt: skip
        measured = [(rows, bucket.recent_floor_ms()) for rows in self.sizes if (bucket := self._bucket(plan, rows))]
        measured = [(rows, ms) for rows, ms in measured if ms is not None]
        if alone is None or not measured:
            return label, Verdict(True, "on: not measured yet (its batch-1 and batched buckets' runs decide)",
                                  judged=now)  # fmt: skip
        rows, batch_ms = max(measured)
        row_ms = batch_ms / rows
        figures = f"a row of a {rows}-row batch runs in {row_ms:.3f} ms, a request alone in {alone:.3f} ms"
        if row_ms < ROW_SHARE * alone:
            return label, Verdict(True, f"on: {figures}", now)
        return label, Verdict(False, f"off: rows get no cheaper ({figures}); measured again after "
                                     f"{RETRY_SECONDS:g} s", now, now)  # fmt: skip

    def _bucket(self, plan: BucketPlan, rows: int) -> ServedBucket | None:
        """The group's bucket at ``rows`` rows, where it has been served."""
        shapes = {name: (rows, *shape[1:]) for name, shape in plan.run_shapes.items()}
        try:
            bucket = self.planner.plan(shapes).bucket
        except Exception:  # noqa: BLE001 - past the batch axis's largest bucket: no such bucket
            return None
        return self.find_bucket(bucket)
