"""Background tuning: one thread that picks the busiest ready bucket not yet
tuned and hands it to :meth:`ModelService.tune`, within a time budget."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .service import BucketState, ModelService, ServedModel

log = logging.getLogger("jitserve")


class BackgroundTuner:
    def __init__(self, service: ModelService) -> None:
        self.service = service
        self.settings = service.settings
        self.spent_seconds = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jitserve-tuner", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def candidates(self) -> list[tuple[ServedModel, BucketState]]:
        """Qualifying buckets, busiest first: ready, untuned, enough hits, top N of their model."""
        s = self.settings
        found = []
        for served in self.service.served_models():
            ready = [
                state
                for state in list(served.buckets.values())
                if state.state == "ready" and not state.tuning and state.hits >= s.tune_min_hits
            ]
            ready.sort(key=lambda state: state.hits, reverse=True)
            found += [(served, state) for state in ready[: s.tune_top_buckets]]
        found.sort(key=lambda pair: pair[1].hits, reverse=True)
        return found

    def _run(self) -> None:
        while not self._stop.wait(self.settings.tuning_interval_seconds):
            if self.spent_seconds >= self.settings.tuning_total_seconds:
                continue
            picked = self.candidates()
            if not picked:
                continue
            served, state = picked[0]
            if served.retired:
                continue
            log.info("tuning %s %s (%d hits)", served.name, state.label, state.hits)
            try:
                self.spent_seconds += self.service.tune(served, state)
            except Exception:  # the tuner must survive any one bucket
                log.exception("tuning %s %s failed unexpectedly", served.name, state.label)
                state.tuning = {"state": "failed", "reason": "internal error"}
