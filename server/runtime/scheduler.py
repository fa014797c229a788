"""The compile queue: bounded, single-flight per bucket, drained by worker
threads that each run one compile child at a time."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable

from compiler.errors import IllegalTransitionError

from .metrics import Metrics
from .registry import ServedModel
from .state import BucketState, ServedBucket

log = logging.getLogger("jitserve")

Job = tuple[ServedModel, ServedBucket]


class CompileScheduler:
    def __init__(
        self, workers: int, queue_size: int, metrics: Metrics, run: Callable[[ServedModel, ServedBucket], None]
    ) -> None:
        self.workers = workers
        self.metrics = metrics
        self._run = run
        self._queue: queue.Queue[Job | None] = queue.Queue(queue_size)
        self._running = 0
        self._running_lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    @property
    def enabled(self) -> bool:
        """With no compile workers jitserve serves everything through ONNX Runtime."""
        return self.workers > 0

    @property
    def free_slots(self) -> int:
        return self._queue.maxsize - self._queue.qsize()

    def start(self) -> None:
        for _ in range(self.workers):
            thread = threading.Thread(target=self._work, name="jitserve-compile", daemon=True)
            thread.start()
            self._threads.append(thread)

    def close(self) -> None:
        # Drop queued compiles so the stop markers fit; running ones end with the process.
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join(timeout=5)

    def enqueue(self, served: ServedModel, bucket: ServedBucket) -> bool:
        """Single-flight: a bucket is queued at most once. False when the queue is full."""
        if not self.enabled or not bucket.move(BucketState.QUEUED, only_from=BucketState.NEW):
            return True
        try:
            self._queue.put_nowait((served, bucket))
        except queue.Full:
            bucket.move(BucketState.NEW, only_from=BucketState.QUEUED)  # the next request for it tries again
            return False
        self._update_depth()
        return True

    def enqueue_warm(self, served: ServedModel) -> None:
        for bucket in served.all_buckets():
            if bucket.warm:
                self.enqueue(served, bucket)

    def _update_depth(self) -> None:
        self.metrics.set_queue_depth(depth=self._queue.qsize() + self._running)

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            served, bucket = job
            with self._running_lock:
                self._running += 1
            self._update_depth()
            try:
                if not served.retired:
                    self._run(served, bucket)
            except Exception:  # a worker must survive any one job
                log.exception("compile of %s %s failed unexpectedly", served.name, bucket.label)
                with contextlib.suppress(IllegalTransitionError):  # already ready: it stays served
                    bucket.fail("internal error")
            finally:
                with self._running_lock:
                    self._running -= 1
                self._update_depth()
