"""Background tuning: one thread that picks the busiest ready bucket not yet
tuned and hands it to the ``tune`` callable it was given, within a time budget."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ...settings import Settings
from ..models.registry import ServedModel
from ..models.state import BucketState, ServedBucket, TuningState, TuningStatus

log = logging.getLogger("jitserve")


class BackgroundTuner:
    def __init__(
        self,
        settings: Settings,
        served_models: Callable[[], list[ServedModel]],
        tune: Callable[[ServedModel, ServedBucket], float],
    ) -> None:
        self.settings = settings
        self._served_models = served_models
        self._tune = tune
        self.spent_seconds = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jitserve-tuner", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def candidates(self) -> list[tuple[ServedModel, ServedBucket]]:
        """Qualifying buckets, busiest first: ready, untuned, enough hits, top N of their model. Symbolic
        buckets are not tuned: MetaSchedule tunes static shapes only."""
        s = self.settings
        found = []
        for served in self._served_models():
            ready = [
                bucket
                for bucket in served.all_buckets()
                if bucket.state is BucketState.READY
                and bucket.tuning is None
                and bucket.traffic.hits >= s.tune_min_hits
                and not bucket.symbolic
            ]
            ready.sort(key=lambda bucket: bucket.traffic.hits, reverse=True)
            found += [(served, bucket) for bucket in ready[: s.tune_top_buckets]]
        found.sort(key=lambda pair: pair[1].traffic.hits, reverse=True)
        return found

    def _run(self) -> None:
        while not self._stop.wait(self.settings.tuning_interval_seconds):
            if self.spent_seconds >= self.settings.tuning_total_seconds:
                continue
            picked = self.candidates()
            if not picked:
                continue
            served, bucket = picked[0]
            if served.retired:
                continue
            log.info("tuning %s %s (%d hits)", served.name, bucket.label, bucket.traffic.hits)
            try:
                self.spent_seconds += self._tune(served, bucket)
            except Exception:  # the tuner must survive any one bucket
                log.exception("tuning %s %s failed unexpectedly", served.name, bucket.label)
                bucket.set_tuning(TuningStatus(state=TuningState.FAILED, reason="internal error"))
