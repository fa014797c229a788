"""The inference threads, shared fairly between models: weighted fair queueing over one queue per model,
and a cap on the threads one model may hold at once.

A plain thread pool runs requests first come, first served: a model under a storm of 32 clients keeps 32
requests ahead of every request to another model, whose latency then grows with the storm. Here each model
queues apart. A free thread takes the next request of the model with the least service so far, each run
counting ``1 / weight`` (start-time fair queueing: a model that was idle starts level with the busiest, not
with the credit of its idle time), so a quiet model's request waits for at most one run of each busy model
per thread, whatever their queues hold. But one run of a slow model can take hundreds of milliseconds, so
while more than one model has been asked within :data:`SHARING_SECONDS`, no model holds every thread: one
is kept for the others (a model alone still gets them all). A model also holds at most
``max_threads_per_model`` threads at once, if that is set.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

SHARING_SECONDS = 1.0
"""Models asked within this many seconds of each other share the threads: none holds the last free one."""

SHARED = "shared"
"""The lane of work submitted without a model (``Executor.submit``)."""


@dataclass
class _Task:
    future: concurrent.futures.Future
    call: Callable[[], Any]
    queued: float = field(default_factory=time.perf_counter)


@dataclass
class _Lane:
    tasks: deque = field(default_factory=deque)
    service: float = 0.0
    """Its virtual time: the runs it started, each 1/weight."""
    running: int = 0


class FairPool(concurrent.futures.Executor):
    def __init__(
        self,
        threads: int,
        name: str,
        *,
        max_threads_per_model: int = 0,
        weight_of: Callable[[Hashable], float] = lambda _key: 1.0,
        on_start: Callable[[Hashable, float], None] = lambda _key, _seconds: None,
        initializer: Callable[[], None] | None = None,
    ) -> None:
        """``max_threads_per_model``: 0 for no cap; ``weight_of(key)``: a model's share (read as its run
        starts); ``on_start(key, seconds)``: a run starts after queueing ``seconds``."""
        self.threads = threads
        self.cap = max_threads_per_model or threads
        self._asked: dict[Hashable, float] = {}
        """When each model last submitted work (within :data:`SHARING_SECONDS`)."""
        self._weight_of = weight_of
        self._on_start = on_start
        self._initializer = initializer
        self._lanes: dict[Hashable, _Lane] = {}
        self._name = name
        self._ready = threading.Condition()
        self._shutdown = False
        self._threads: list[threading.Thread] = []
        self._idle = 0
        """Threads waiting for work: a submit finding none starts another, up to ``threads`` (as a
        ThreadPoolExecutor does, so an unused pool, the cold lane on a warm server, holds no threads)."""

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        return self.submit_as(SHARED, fn, *args, **kwargs)

    def submit_as(self, key: Hashable, fn: Callable, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        """``fn(*args, **kwargs)`` in ``key``'s lane (a model's name)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._ready:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._asked[key] = time.monotonic()
            lane = self._lanes.get(key)
            if lane is None:  # back from idle: level with the least served busy lane, no credit for the idle time
                busy = [other.service for other in self._lanes.values()]
                lane = self._lanes[key] = _Lane(service=min(busy, default=0.0))
            lane.tasks.append(_Task(future, lambda: fn(*args, **kwargs)))
            if self._idle == 0 and len(self._threads) < self.threads:
                thread = threading.Thread(target=self._work, name=f"{self._name}_{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
            self._ready.notify()
        return future

    def lane(self, key: Hashable) -> concurrent.futures.Executor:
        """An executor whose work runs in ``key``'s lane (a model's batches)."""
        return _LaneExecutor(self, key)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._ready:
            self._shutdown = True
            if cancel_futures:
                for lane in self._lanes.values():
                    while lane.tasks:
                        lane.tasks.popleft().future.cancel()
            self._ready.notify_all()
        if wait:
            for thread in self._threads:
                thread.join()

    def _next(self) -> tuple[Hashable, _Lane, _Task] | None:
        """The next run: the least served lane with work and a thread to spare; None when shut down and drained."""
        with self._ready:
            while True:
                cap = self._cap()
                eligible = [(lane.service, key) for key, lane in self._lanes.items()
                            if lane.tasks and lane.running < cap]  # fmt: skip
                if eligible:
                    _, key = min(eligible, key=lambda item: item[0])
                    lane = self._lanes[key]
                    task = lane.tasks.popleft()
                    lane.running += 1
                    lane.service += 1.0 / self._weight(key)
                    return key, lane, task
                if self._shutdown and not any(lane.tasks for lane in self._lanes.values()):
                    return None
                self._idle += 1
                try:
                    self._ready.wait(SHARING_SECONDS)  # a cap lifts as the other models go quiet
                finally:
                    self._idle -= 1

    def _cap(self) -> int:
        """The threads one model may hold now: all but one while others were asked lately (the shared lane's
        short work of no one model does not count)."""
        now = time.monotonic()
        for key, asked in list(self._asked.items()):
            if now - asked > SHARING_SECONDS:
                del self._asked[key]
        models = sum(key != SHARED for key in self._asked)
        return min(self.cap, self.threads - 1) if models > 1 and self.threads > 1 else self.cap

    def _weight(self, key: Hashable) -> float:
        try:
            return max(float(self._weight_of(key)), 1e-6)
        except Exception:  # noqa: BLE001 - a model gone meanwhile: its lane is served at the default weight
            return 1.0

    def _work(self) -> None:
        if self._initializer is not None:
            self._initializer()
        while (picked := self._next()) is not None:
            self._run(*picked)
            del picked  # an idle thread must not keep its last request (its model's engine) alive

    def _run(self, key: Hashable, lane: _Lane, task: _Task) -> None:
        try:
            if task.future.set_running_or_notify_cancel():
                self._on_start(key, time.perf_counter() - task.queued)
                try:
                    result = task.call()
                except BaseException as exc:  # noqa: BLE001 - the caller's future carries it
                    task.future.set_exception(exc)
                else:
                    task.future.set_result(result)
        finally:
            with self._ready:
                lane.running -= 1
                if not lane.tasks and not lane.running and self._lanes.get(key) is lane:
                    del self._lanes[key]  # idle: an unloaded model's lane goes; a returning one is levelled
                self._ready.notify()


class _LaneExecutor(concurrent.futures.Executor):
    def __init__(self, pool: FairPool, key: Hashable) -> None:
        self.pool, self.key = pool, key

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        return self.pool.submit_as(self.key, fn, *args, **kwargs)
