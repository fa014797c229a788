"""Dynamic batching, bucket-aware: concurrent requests of one model whose
other axes fall in the same bucket are joined along the batch axis into one
run, then split back.

One owner thread per batching model holds the waiting requests in a private
:class:`BatchQueue` (unit-tested without threads); requests reach it through
an inbox. While a batch runs, new requests wait in the inbox, so under load
the next batch is formed from them at once; under light load a request waits
at most ``max_queue_delay_us`` for company, and not at all while requests
arrive further apart than that (the window adapts to the load).
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from compiler.models.signature import Signature
from compiler.shapes.buckets import AxisPolicy, AxisSafety

from ..observability.metrics import Metrics


class DynamicBatching(BaseModel):
    """A model's ``dynamic_batching`` config."""

    model_config = ConfigDict(extra="forbid")

    max_batch_size: int = Field(8, ge=1, le=4096, description="most rows (batch-axis entries) in one run")
    max_queue_delay_us: int = Field(
        500, ge=0, le=10_000_000, description="longest a request waits for others to join it, in microseconds"
    )
    preferred_batch_sizes: list[int] | None = Field(
        None, description="row counts dispatched without waiting for more; default: the batch axis's buckets"
    )

    @model_validator(mode="after")
    def _check(self) -> DynamicBatching:
        if self.preferred_batch_sizes is not None:
            if any(not 1 <= size <= self.max_batch_size for size in self.preferred_batch_sizes):
                raise ValueError("preferred_batch_sizes must lie in 1..max_batch_size")
            self.preferred_batch_sizes = sorted(set(self.preferred_batch_sizes))
        return self

    def preferred(self, policy: AxisPolicy) -> set[int]:
        """The preferred row counts: as configured, else the batch axis's bucket sizes up to the maximum."""
        if self.preferred_batch_sizes is not None:
            return set(self.preferred_batch_sizes)
        sizes = {policy.bucket_size(rows) for rows in range(1, self.max_batch_size + 1)}
        return {size for size in sizes if size is not None and size <= self.max_batch_size}


def find_batch_axis(signature: Signature, safety: dict[str, AxisSafety]) -> tuple[str | None, str]:
    """The axis requests can be joined along, or None and why not.

    It must be dim 0 of every input, verified padding-safe, and dim 0 of every
    output must follow it (what the padding-safety check found).
    """
    axis = signature.leading_axis()
    if axis is None:
        return None, "dim 0 of the inputs is not one shared symbolic axis"
    check = safety.get(axis)
    if check is None or not check.safe:
        return None, f"axis {axis!r} is not verified padding-safe: {check.reason if check else 'not checked'}"
    for output in signature.output_names:
        if 0 not in check.output_axes.get(output, []):
            return None, f"dim 0 of output {output!r} does not follow axis {axis!r}"
    return axis, f"requests are joined along axis {axis!r}"


@dataclass
class Waiting:
    """One request in the queue."""

    item: Any
    group: Hashable
    rows: int
    arrived: float
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


GAP_WEIGHT = 0.2
"""Weight of the newest gap between arrivals in their running average (about the last five count)."""


class BatchQueue:
    """The owner thread's private state: the waiting requests, grouped, and when a batch goes."""

    def __init__(self, max_batch_size: int, max_delay_s: float, preferred: set[int]) -> None:
        self.max_batch_size = max_batch_size
        self.max_delay_s = max_delay_s
        self.preferred = preferred
        self._groups: dict[Hashable, list[Waiting]] = {}  # in order of their oldest request
        self.gap_s = 0.0
        """The time between arrivals, averaged over the last few (a busy model until told otherwise)."""
        self._last_arrival: float | None = None

    @property
    def delay_s(self) -> float:
        """How long a request waits for company now: the configured delay while another request is due
        within it, else none (at low load a lone request would wait for nothing)."""
        return self.max_delay_s if self.gap_s < self.max_delay_s else 0.0

    def __len__(self) -> int:
        return sum(len(group) for group in self._groups.values())

    def add(self, waiting: Waiting) -> None:
        if self._last_arrival is not None:
            self.gap_s += GAP_WEIGHT * (max(0.0, waiting.arrived - self._last_arrival) - self.gap_s)
        self._last_arrival = waiting.arrived
        self._groups.setdefault(waiting.group, []).append(waiting)

    def deadline(self) -> float | None:
        """When the oldest waiting request must be dispatched; None when nothing waits."""
        oldest = min((group[0].arrived for group in self._groups.values()), default=None)
        return None if oldest is None else oldest + self.delay_s

    def take(self, now: float, *, flush: bool = False, instances: int = 1) -> list[Waiting] | None:
        """The next batch to run, oldest group first; None while every group may still wait.

        A group goes when it cannot grow (the next request would pass the
        maximum), when its rows are a preferred size, or when its oldest
        request has waited the delay; ``flush`` sends any group. With other
        ``instances`` idle, a going group is shared: this batch takes its
        share of the rows, rounded up to a preferred size.
        """
        for key, group in self._groups.items():
            batch, rows = self._fill(group, self.max_batch_size)
            full = len(batch) < len(group) or rows >= self.max_batch_size
            if not (flush or full or rows in self.preferred or now >= group[0].arrived + self.delay_s):
                continue
            if instances > 1:
                share = -(-rows // instances)
                share = min((size for size in self.preferred if size >= share), default=share)
                if share < rows:
                    batch, rows = self._fill(group, share)
            del group[: len(batch)]
            if not group:
                del self._groups[key]
            return batch
        return None

    @staticmethod
    def _fill(group: list[Waiting], limit: int) -> tuple[list[Waiting], int]:
        """The oldest requests of a group up to ``limit`` rows (always at least one)."""
        batch, rows = [], 0
        for waiting in group:
            if batch and rows + waiting.rows > limit:
                break
            batch.append(waiting)
            rows += waiting.rows
        return batch, rows


_STOP = object()


class DynamicBatcher:
    """One model's batching queue and the owner thread that forms its batches.

    Like Triton's dynamic batcher, a batch is formed only when one of the
    model's ``instances`` is free to run it (on ``executor``): while every
    instance is busy, requests pile up and the next batch takes them. When
    several instances are idle they share the waiting rows, so that one batch
    never holds every request while another instance has nothing to run.
    """

    def __init__(
        self,
        model: str,
        config: DynamicBatching,
        preferred: set[int],
        run_batch: Callable[[list[Any]], list[Any]],
        metrics: Metrics,
        *,
        instances: int,
        executor: concurrent.futures.Executor,
    ) -> None:
        """``run_batch`` takes the items of one batch and returns, per item, its result or its exception."""
        self.model = model
        self._queue = BatchQueue(config.max_batch_size, config.max_queue_delay_us / 1e6, preferred)
        self._run_batch = run_batch
        self._metrics = metrics
        self._executor = executor
        self._idle = instances
        self._instance_freed = threading.Condition()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._stopping = False
        self._thread = threading.Thread(target=self._own, name=f"jitserve-batch-{model}", daemon=True)
        self._thread.start()

    def submit(self, item: Any, *, group: Hashable, rows: int) -> concurrent.futures.Future:
        """Queue ``item`` (``rows`` along the batch axis) to run with others of its ``group``."""
        if self._closed:
            raise RuntimeError("batcher is closed")
        waiting = Waiting(item, group, rows, time.monotonic())
        self._inbox.put(waiting)
        return waiting.future

    def close(self) -> None:
        """Run what is queued, then stop the owner thread."""
        if not self._closed:
            self._closed = True
            self._inbox.put(_STOP)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _own(self) -> None:
        while True:
            with self._instance_freed:  # an instance to run the next batch
                self._instance_freed.wait_for(lambda: self._idle > 0)
                self._idle -= 1
            batch = self._next_batch()
            if batch is None:
                return
            try:
                self._executor.submit(self._run, batch)
            except RuntimeError as exc:  # the executor is shut down
                self._release_instance()
                self._settle(batch, [exc] * len(batch))

    def _next_batch(self) -> list[Waiting] | None:
        """The next batch, waiting for company up to its delay; None once closed and empty."""
        timeout: float | None = 0.0
        while True:
            self._receive(timeout)
            # Rows waiting are split between this instance and the others idle too.
            batch = self._queue.take(time.monotonic(), flush=self._stopping, instances=1 + self._idle)
            if batch or self._stopping:
                return batch
            deadline = self._queue.deadline()
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())

    def _receive(self, timeout: float | None) -> None:
        """Move the inbox into the queue, first waiting up to ``timeout`` (None: for ever) for an item."""
        block = timeout != 0.0
        while True:
            try:
                waiting = self._inbox.get(timeout=timeout) if block else self._inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if waiting is _STOP:
                self._stopping = True
            else:
                self._queue.add(waiting)

    def _run(self, batch: list[Waiting]) -> None:
        try:
            started = time.monotonic()
            self._metrics.serving.record_batch(
                model=self.model, rows=sum(w.rows for w in batch), waits=[started - w.arrived for w in batch]
            )
            try:
                results = self._run_batch([w.item for w in batch])
            except Exception as exc:  # noqa: BLE001 - a bug in the run fails its requests, not the batcher
                results = [exc] * len(batch)
            self._settle(batch, results)
        finally:
            self._release_instance()

    def _release_instance(self) -> None:
        with self._instance_freed:
            self._idle += 1
            self._instance_freed.notify()

    @staticmethod
    def _settle(batch: list[Waiting], results: list[Any]) -> None:
        for waiting, result in zip(batch, results, strict=True):
            if not waiting.future.set_running_or_notify_cancel():
                continue  # the client went away
            if isinstance(result, BaseException):
                waiting.future.set_exception(result)
            else:
                waiting.future.set_result(result)
