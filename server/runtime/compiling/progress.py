"""Live tuning progress: the tuning child writes its trials and best time to
a file as it goes; a watch thread in the server reads it into the bucket's
tuning status and the trials metric."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..models.state import ServedBucket, TuningState, TuningStatus
from ..observability.metrics import Metrics


@dataclass
class TuningProgress:
    trials: int = 0
    best_ms: float | None = None


class TuningWatch:
    """Follows a tuning child's progress file: live trials and best time in the bucket's tuning
    status and in the trials metric while tuning runs."""

    def __init__(self, path: Path, bucket: ServedBucket, metrics: Metrics, *, model: str, interval: float = 0.5):
        self.path = path
        self.bucket = bucket
        self.metrics = metrics
        self.model = model
        self.interval = interval
        self.progress = TuningProgress()
        self._started = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jitserve-tuning-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> TuningProgress:
        self._stop.set()
        self._thread.join()
        self.poll()
        self.path.unlink(missing_ok=True)
        return self.progress

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()

    def poll(self) -> None:
        try:
            seen = json.loads(self.path.read_text())
            trials, best_ms = int(seen["trials"]), seen["best_ms"]
        except (OSError, ValueError, KeyError, TypeError):
            return  # not written yet, or being replaced
        if trials <= self.progress.trials:
            return
        self.metrics.compiles.record_tuning(model=self.model, trials=trials - self.progress.trials, seconds=0.0)
        self.progress = TuningProgress(trials, round(best_ms, 4) if best_ms is not None else None)
        seconds = round(time.perf_counter() - self._started, 1)
        self.bucket.set_tuning(
            TuningStatus(state=TuningState.TUNING, trials=trials, best_ms=self.progress.best_ms, seconds=seconds)
        )
