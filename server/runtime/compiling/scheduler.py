"""The compile queue: bounded, single-flight per bucket, drained by worker
threads that each run one compile child at a time, the busiest bucket first
(warm buckets before any: they were asked for). A queued compile that
``hold`` names waits in the queue (compile admission holds a dynamic bucket's
compile while its model is in a shape storm)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

from compiler.errors import IllegalTransitionError

from ..models.registry import ServedModel
from ..models.state import BucketState, ServedBucket
from ..observability.metrics import Metrics

log = logging.getLogger("jitserve")

HOLD_RECHECK_SECONDS = 1.0
"""How often a worker looks again at compiles held in the queue."""

CompileJob = tuple[ServedModel, ServedBucket]


class CompileScheduler:
    def __init__(
        self,
        workers: int,
        queue_size: int,
        metrics: Metrics,
        run: Callable[[ServedModel, ServedBucket], None],
        *,
        hold: Callable[[ServedModel, ServedBucket], bool] = lambda _served, _bucket: False,
    ) -> None:
        self.workers = workers
        self.metrics = metrics
        self._run = run
        self.queue_size = queue_size
        self._queued: list[CompileJob] = []
        self._running = 0
        self._closed = False
        self._changed = threading.Condition()
        self._threads: list[threading.Thread] = []
        self.hold = hold
        """Whether a queued compile must wait for now."""

    @property
    def enabled(self) -> bool:
        """With no compile workers jitserve serves everything through ONNX Runtime."""
        return self.workers > 0

    @property
    def free_slots(self) -> int:
        return self.queue_size - len(self._queued)

    @property
    def queued(self) -> int:
        return len(self._queued)

    @property
    def running(self) -> int:
        return self._running

    @property
    def pending(self) -> int:
        """Compiles queued or running."""
        return len(self._queued) + self._running

    def start(self) -> None:
        for _ in range(self.workers):
            thread = threading.Thread(target=self._work, name="jitserve-compile", daemon=True)
            thread.start()
            self._threads.append(thread)

    def close(self) -> None:
        # Queued compiles are dropped; running ones end with the process.
        with self._changed:
            self._closed = True
            self._queued.clear()
            self._changed.notify_all()
        for thread in self._threads:
            thread.join(timeout=5)

    def enqueue(self, served: ServedModel, bucket: ServedBucket) -> bool:
        """Single-flight: a bucket is queued at most once. False when the queue is full."""
        if not self.enabled:
            return True
        with self._changed:
            if len(self._queued) >= self.queue_size:
                return False
            if not bucket.move(BucketState.ADMITTED, only_from=BucketState.COLD):
                return True
            self._queued.append((served, bucket))
            self._changed.notify()
        self._update_depth()
        return True

    def enqueue_warm(self, served: ServedModel) -> None:
        for bucket in served.all_buckets():
            if bucket.warm:
                self.enqueue(served, bucket)

    def _retry_later(self, served: ServedModel, bucket: ServedBucket, seconds: float) -> None:
        """Queue a failed bucket again after ``seconds`` (unless closed, retired or the queue is full)."""

        def retry() -> None:
            with self._changed:
                if self._closed or served.retired or len(self._queued) >= self.queue_size:
                    bucket.stop_retrying(f"{bucket.reason}; not retried: the server is busy or shutting down")
                    return
                if not bucket.move(BucketState.ADMITTED, only_from=BucketState.FAILED):
                    return
                self._queued.append((served, bucket))
                self._changed.notify()
            self._update_depth()

        timer = threading.Timer(seconds, retry)
        timer.daemon = True
        timer.start()

    def _update_depth(self) -> None:
        self.metrics.compiles.set_queue_depth(depth=self.pending)

    def _take(self) -> CompileJob | None:
        """The next compile: warm buckets first, then the one with the most recent traffic."""
        with self._changed:
            while not self._closed:
                ready = [job for job in self._queued if not self.hold(*job)]
                if ready:
                    break
                self._changed.wait(HOLD_RECHECK_SECONDS if self._queued else None)
            if self._closed:
                return None
            now = time.monotonic()
            job = max(ready, key=lambda job: (job[1].warm, job[1].traffic.heat(now)))
            self._queued.remove(job)
            self._running += 1
            return job

    def _work(self) -> None:
        while True:
            job = self._take()
            if job is None:
                return
            self._do(*job)
            # No reference outlives the job: a deleted model's memory must not wait for the next compile.
            del job

    def _do(self, served: ServedModel, bucket: ServedBucket) -> None:
        self._update_depth()
        try:
            if not served.retired:
                self._run(served, bucket)
                if bucket.retry_pending:
                    self._retry_later(served, bucket, bucket.retry_in or 0.0)
        except Exception:  # a worker must survive any one job
            log.exception("compile of %s %s failed unexpectedly", served.name, bucket.label)
            with contextlib.suppress(IllegalTransitionError):  # already ready: it stays served
                bucket.fail("internal error")
        finally:
            with self._changed:
                self._running -= 1
            self._update_depth()
