"""Compile admission: a bucket is compiled only once it has earned it.

Every request to a ``cold`` bucket (ONNX Runtime serves it) asks
:meth:`CompileAdmission.consider`, which admits the bucket to the compile
queue, or says why not:

- ``padding_probe``: the model's padding probe has not ended: its requests are
  planned without padding, into buckets its verdicts may soon replace;
- ``below_threshold``: fewer than ``compile_min_hits`` hits within the window;
- ``storm``: the model saw more than ``storm_new_buckets`` new shapes (new
  buckets, or new sizes of a symbolic bucket) within the window: new shapes
  arrive faster than compiles could pay off, or would take the cores from
  established traffic while it lasts;
- ``cap``: the model has ``max_compiled_buckets`` buckets compiled or on the
  way, none of them half as hot as this one (a bucket twice as hot as the
  coldest evicts it);
- ``budget``: ``compiles_per_window`` compiles were admitted within the window
  over all models;
- ``queue_full``: the compile queue has no room.

Warm buckets (asked for at upload) skip every check; a bucket whose route an
earlier process measured skips the threshold and the budget (it reloads its
kernel, nothing compiles). The queue runs the busiest bucket first.

A dynamic bucket gathers a width storm into one bucket that earns its compile
within the storm's first requests. Its new sizes count as new shapes in every
state, and its compile is held in the queue for ``SETTLE_SECONDS`` after its
first request and for as long as its model is in a storm: the storm's compile
waits for the storm to pass instead of taking the cores from established
traffic while it lasts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from compiler.storage.store import KernelStore

from ...settings import Settings
from ..models.registry import ServedModel
from ..models.state import BucketState, ServedBucket
from ..observability.metrics import Metrics
from .router import Router
from .scheduler import CompileScheduler

log = logging.getLogger("jitserve")

SETTLE_SECONDS = 2.0
"""A dynamic bucket's compile waits this long after its first request: a width storm shows by then
(more than ``storm_new_buckets`` new sizes) and holds the compile until it passes."""

WAITING_FOR_VERDICTS = "cold: waiting for the padding probe's verdicts"
"""A cold bucket's reason while its model's padding probe runs."""
HOLDS_A_SLOT = (BucketState.ADMITTED, BucketState.COMPILING, BucketState.READY)
EVICTION_MARGIN = 2.0
"""A bucket evicts the coldest compiled one only when this many times hotter: no thrashing between equals."""


def compile_held(settings: Settings, served: ServedModel, bucket: ServedBucket) -> bool:
    """Whether a queued compile waits (the scheduler's ``hold``): a dynamic bucket's, until
    ``SETTLE_SECONDS`` after its first request (a storm shows by then) and while its model is in a storm.
    Reads no admission state under a lock: the scheduler asks under its own."""
    if bucket.warm or not bucket.symbolic:
        return False
    now = time.monotonic()
    if bucket.traffic.first_seen is not None and now - bucket.traffic.first_seen < SETTLE_SECONDS:
        return True
    window = settings.compile_hit_window_seconds
    return is_storm(settings, sum(1 for seen in tuple(served.new_buckets) if now - seen <= window))


def is_storm(settings: Settings, new_buckets: int) -> bool:
    """More new shapes within the window than ``storm_new_buckets``."""
    return new_buckets > settings.storm_new_buckets


class CompileAdmission:
    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        scheduler: CompileScheduler,
        router: Router,
        artifacts: KernelStore,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.scheduler = scheduler
        self.router = router
        self.artifacts = artifacts
        self._admitted_at: deque[float] = deque()  # compiles admitted within the window, all models
        self._lock = threading.Lock()

    @property
    def window(self) -> float:
        return self.settings.compile_hit_window_seconds

    def record_hit(self, bucket: ServedBucket) -> None:
        bucket.traffic.record_hit(window=self.window)

    def established(self, served: ServedModel, bucket: ServedBucket | None) -> bool:
        """Traffic that has earned its place: a warm bucket, one with its kernel, or one on its way to
        a compile or with the hits a compile needs within the window, unless the model is in a shape
        storm (its buckets without a kernel are the storm's, however hot: a dynamic bucket gathers a
        width storm). None: a new shape."""
        if bucket is None:
            return False
        if bucket.warm or bucket.state is BucketState.READY:
            return True
        now = time.monotonic()
        if bucket.state is BucketState.COLD and not bucket.traffic.hits_within(
            self.window, now, self.settings.compile_min_hits
        ):
            return False
        with self._lock:
            return not self._storm(served, now)[1]

    def note_sizes(self, served: ServedModel, bucket: ServedBucket, sizes: tuple) -> None:
        """A request's sizes of a dynamic bucket's symbolic dims: sizes it has not had before are new shapes
        (the first request's are the new bucket itself)."""
        if bucket.traffic.first_time_size(sizes) and bucket.traffic.first_seen is not None:
            with self._lock:
                self._note_new_bucket(served, time.monotonic())

    def consider(self, served: ServedModel, bucket: ServedBucket) -> None:
        """A request to a cold bucket: admit it to the compile queue, restore its route, or say why not."""
        if not self.scheduler.enabled or served.retired:
            return
        if not served.padding_probe.settled:
            bucket.note(WAITING_FOR_VERDICTS)
            self.metrics.compiles.record_admission(model=served.name, decision="deferred", reason="padding_probe")
            return
        now = time.monotonic()
        with self._lock:
            if bucket.state is not BucketState.COLD:
                return
            if bucket.traffic.first_seen is None:
                bucket.traffic.first_seen = now
                self._note_new_bucket(served, now)
            decision, reason, why = self._decide(served, bucket, now)
            if decision == "admitted" and reason != "restored":
                if not self.scheduler.enqueue(served, bucket):
                    decision, reason, why = "refused", "queue_full", "compile queue is full"
                elif reason != "stored":
                    self._admitted_at.append(now)
            bucket.note(why)
        self.metrics.compiles.record_admission(model=served.name, decision=decision, reason=_metric_reason(reason))

    def describe(self, served: ServedModel) -> dict:
        """The model's admission facts for ``GET /models/{name}``."""
        now = time.monotonic()
        with self._lock:
            new_buckets, storm = self._storm(served, now)
            return {
                "storm": storm,
                "new_buckets_in_window": new_buckets,
                "compiled_buckets": len(self._holding_slots(served)),
                "max_compiled_buckets": self.settings.max_compiled_buckets,
                "compiles_admitted_in_window": self._recent(self._admitted_at, now),
            }

    # -- the decision ------------------------------------------------------

    def _decide(self, served: ServedModel, bucket: ServedBucket, now: float) -> tuple[str, str, str]:
        """(decision, reason, the bucket's reason text); runs under the lock."""
        s = self.settings
        if bucket.warm:
            return "admitted", "warm", "admitted: a warm bucket"
        remembered = self._remembered(served, bucket)
        if not remembered and not bucket.traffic.hits_within(self.window, now, s.compile_min_hits):
            return (
                "deferred",
                "below_threshold",
                (f"cold: fewer than {s.compile_min_hits} requests within {self.window:g} s"),
            )
        new_buckets, storm = self._storm(served, now)
        if storm and not remembered:
            return (
                "refused",
                "storm",
                (
                    f"cold: shape storm, {new_buckets} new buckets within {self.window:g} s "
                    f"(more than {s.storm_new_buckets}); onnxruntime serves them"
                ),
            )
        stored = remembered or self.artifacts.get(bucket.key) is not None
        if not stored and self._recent(self._admitted_at, now) >= s.compiles_per_window:
            return "refused", "budget", f"cold: {s.compiles_per_window} compiles admitted within {self.window:g} s"
        if not self._make_room(served, bucket, now):
            return (
                "refused",
                "cap",
                (f"cold: {s.max_compiled_buckets} buckets of the model compiled or admitted, none half as busy"),
            )
        if remembered and self.router.restore(served, bucket):
            # a route kept off a kernel says why (a demotion), as it did before the restart
            return "admitted", "restored", bucket.reason or "restored: routed by an earlier process"
        return "admitted", "stored" if stored else "threshold", "admitted: waiting for a compile worker"

    def _make_room(self, served: ServedModel, bucket: ServedBucket, now: float) -> bool:
        """Under the cap, or the coldest compiled bucket (if ``bucket`` is twice as hot) evicted."""
        holding = self._holding_slots(served)
        if len(holding) < self.settings.max_compiled_buckets:
            return True
        evictable = [b for b in holding if b.state is BucketState.READY]
        if not evictable:
            return False
        coldest = min(evictable, key=lambda b: b.traffic.heat(now))
        if coldest.traffic.heat(now) * EVICTION_MARGIN > bucket.traffic.heat(now) or not coldest.evict(
            f"cold: evicted for the hotter bucket {bucket.label} (cap {self.settings.max_compiled_buckets})"
        ):
            return False
        self.metrics.compiles.record_admission(model=served.name, decision="evicted", reason="hotter_bucket")
        log.info("evicted %s %s for %s", served.name, coldest.label, bucket.label)
        return True

    # -- counting ----------------------------------------------------------

    def refresh_storm_gauges(self, models: list[ServedModel]) -> None:
        """A storm ends with time alone: the gauge is set from the window at each scrape."""
        now = time.monotonic()
        with self._lock:
            for served in models:
                self._storm(served, now)

    def _storm(self, served: ServedModel, now: float) -> tuple[int, bool]:
        """(new buckets within the window, whether that makes a storm); keeps the gauge true."""
        new_buckets = self._recent(served.new_buckets, now)
        storm = self._is_storm(new_buckets)
        self.metrics.compiles.set_shape_storm(model=served.name, storm=storm)
        return new_buckets, storm

    def _is_storm(self, new_buckets: int) -> bool:
        return is_storm(self.settings, new_buckets)

    def _note_new_bucket(self, served: ServedModel, now: float) -> None:
        served.new_buckets.append(now)
        self._recent(served.new_buckets, now)  # trimmed as it grows: a storm's times never pile up

    def _recent(self, times: deque[float], now: float) -> int:
        """Drop the times older than the window; count the rest."""
        while times and now - times[0] > self.window:
            times.popleft()
        return len(times)

    @staticmethod
    def _holding_slots(served: ServedModel) -> list[ServedBucket]:
        return [b for b in served.all_buckets() if b.state in HOLDS_A_SLOT and not b.warm]

    @staticmethod
    def _remembered(served: ServedModel, bucket: ServedBucket) -> bool:
        known = served.record.buckets.get(bucket.label)
        return known is not None and known.key == bucket.key and known.route is not None


def _metric_reason(reason: str) -> str:
    # A stored kernel is admitted past the threshold like any other; it only skips the budget.
    return "threshold" if reason == "stored" else reason
