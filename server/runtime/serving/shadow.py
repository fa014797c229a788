"""Shadow verification: a sample of the requests a compiled kernel answered
runs again on ONNX Runtime, off the hot path, and a kernel whose answer
differs is taken off its bucket.

A kernel is verified at compile time on seeded random inputs; real inputs
are not random (saturated pixels, padded attention masks, token ids at the
vocabulary's ends). The sample is drawn at ``shadow_rate`` and capped at
``shadow_max_per_second``; one thread at idle priority checks it. A full
queue drops the sample: a request is never delayed for its check.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import queue
import random
import threading
import time
from dataclasses import dataclass

import numpy as np

from ...settings import Settings
from ..compiling.router import Router
from ..models.registry import ServedModel
from ..models.state import BucketState, ServedBucket
from ..observability.metrics import Metrics
from .priority import idle_thread_priority

log = logging.getLogger("jitserve")


@dataclass(frozen=True)
class Sample:
    served: ServedModel
    bucket: ServedBucket
    engine: str
    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]


def summarize(inputs: dict[str, np.ndarray]) -> str:
    """What the log may keep of a request: each input's shape and range, and a hash of its bytes."""
    parts = []
    for name, array in inputs.items():
        digest = hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()[:16]
        low, high = (array.min(), array.max()) if array.size else (None, None)
        parts.append(f"{name}: {array.dtype}{list(array.shape)} min {low} max {high} sha256 {digest}")
    return "; ".join(parts)


class ShadowChecks:
    def __init__(self, settings: Settings, metrics: Metrics, router: Router) -> None:
        self.rate = settings.shadow_rate
        self.per_second = settings.shadow_max_per_second
        self.metrics = metrics
        self.router = router
        self._queue: queue.Queue[Sample | None] = queue.Queue(settings.shadow_queue_size)
        self._window_start = 0.0
        self._taken = 0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def offer(
        self,
        served: ServedModel,
        bucket: ServedBucket,
        engine: str,
        inputs: dict[str, np.ndarray],
        outputs: dict[str, np.ndarray],
    ) -> None:
        """A request ``engine`` (a kernel) answered: sampled for a check, or not. Never waits."""
        if self.rate <= 0 or random.random() >= self.rate:
            return
        if not self._within_cap():
            self.metrics.correctness.record_shadow_check(model=served.name, outcome="dropped")
            return
        self._start()
        try:
            self._queue.put_nowait(Sample(served, bucket, engine, inputs, outputs))
        except queue.Full:
            self.metrics.correctness.record_shadow_check(model=served.name, outcome="dropped")

    def close(self) -> None:
        if self._thread is not None:
            with contextlib.suppress(queue.Full):  # a full queue: the thread is a daemon, it ends with us
                self._queue.put_nowait(None)
            self._thread.join(5)

    def _within_cap(self) -> bool:
        """At most ``per_second`` samples in each second."""
        now = time.monotonic()
        with self._lock:
            if now - self._window_start >= 1.0:
                self._window_start, self._taken = now, 0
            if self._taken >= self.per_second:
                return False
            self._taken += 1
            return True

    def _start(self) -> None:
        """The checking thread, started with the first sample."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="jitserve-shadow", daemon=True)
                self._thread.start()

    def _work(self) -> None:
        idle_thread_priority()
        while (sample := self._queue.get()) is not None:
            try:
                self.check(sample)
            except Exception:
                log.exception("shadow check of %s failed", sample.served.name)
            # Not held while the queue waits: a sample keeps its model (weights, sessions) alive, and a
            # deleted model must give its memory back.
            del sample

    def check(self, sample: Sample) -> bool | None:
        """Run the sample on ONNX Runtime and compare; demote the kernel if it differs. Returns whether it
        matched (None: not checked, its kernel no longer serves the bucket or ONNX Runtime failed)."""
        served, bucket = sample.served, sample.bucket
        if served.retired or bucket.state is not BucketState.READY or bucket.route != sample.engine:
            return None
        try:
            reference = served.ort.run(sample.inputs)
        except Exception as exc:  # noqa: BLE001 - ONNX Runtime's own failure is no verdict on the kernel
            log.warning("shadow check of %s %s: onnxruntime failed: %s", served.name, bucket.label, exc)
            self.metrics.correctness.record_shadow_check(model=served.name, outcome="error")
            return None
        comparison = served.compare(sample.engine, sample.outputs, reference)
        tolerance = served.planner.approximate_tolerance(bucket.bucket)
        matched = comparison.matches or (tolerance is not None and comparison.max_abs_error <= tolerance)
        self.metrics.correctness.record_shadow_check(model=served.name, outcome="match" if matched else "mismatch")
        if matched:
            return True
        reason = (
            f"shadow check: output {comparison.worst_output!r} differed by {comparison.max_abs_error:.3g} "
            f"on a served request; {sample.engine} demoted, onnxruntime serves"
        )
        if self.router.demote(served, bucket, sample.engine, reason):
            self.metrics.correctness.record_shadow_demotion(model=served.name)
            summary = summarize(sample.inputs)
            log.warning("model %s bucket %s: %s (input %s)", served.name, bucket.label, reason, summary)
        return False
