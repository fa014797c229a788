"""The prediction path: parse the inputs, pick the bucket, run its kernel
(pad, run, cut back) or ONNX Runtime, and account for every request.

A request is prepared (parsed and planned) where it arrives, then run in
one of four places: its model's dynamic batcher when it has one; the event
loop itself when its bucket's runs are measured to cost less than a hop to a
thread; the cold lane (threads of idle priority) when its shape is new (its
bucket has not earned a compile), so that a storm of new shapes cannot slow
established traffic; else the inference threads. Both pools share one
bounded queue, past which requests answer 503.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from compiler.errors import JitServeError, UnavailableError
from compiler.running.arrays import contiguous
from compiler.running.engines import Engine
from compiler.shapes.buckets import BucketPlan, bucket_label, pad_inputs

from ..compiling.compile_admission import CompileAdmission
from ..compiling.openvino_builds import OPENVINO
from ..memory.kernel_cache import Kernels
from ..models.registry import Registry, ServedModel
from ..models.state import BucketState, ServedBucket
from ..observability.metrics import Metrics
from .fair_pool import SHARED, FairPool
from .inputs import parse_inputs
from .priority import idle_thread_priority

if TYPE_CHECKING:
    from .shadow import ShadowChecks

log = logging.getLogger(__name__)

T = TypeVar("T")

PROTOCOL: contextvars.ContextVar[str] = contextvars.ContextVar("protocol", default="rest")
"""The protocol of the request being served (``rest`` or ``grpc``), for its metrics: set by the gRPC
adapter for each call, carried onto the inference threads by :meth:`Inference.offload` and into a batch
by its jobs."""


@dataclass(frozen=True)
class Prediction:
    model: str
    version: int
    outputs: dict[str, np.ndarray]
    engine: str
    bucket: str
    inference_ms: float
    """The engine's share of the request (pad, run, cut back), in milliseconds."""

    @property
    def nbytes(self) -> int:
        return sum(array.nbytes for array in self.outputs.values())

    def body(self) -> dict[str, Any]:
        """The response body: everything but the timing, which travels as a header."""
        return {
            "model": self.model,
            "version": self.version,
            "outputs": self.outputs,
            "engine": self.engine,
            "bucket": self.bucket,
        }


@dataclass
class Job:
    """One request, parsed and planned: everything its run needs."""

    served: ServedModel
    arrays: dict[str, np.ndarray]
    plan: BucketPlan | None
    """None for a zero-size input: no bucket, ONNX Runtime runs it as sent."""
    started: float
    protocol: str = "rest"

    @property
    def rows(self) -> int:
        """Entries along dim 0 (the batch axis when the model batches)."""
        return next(iter(self.arrays.values())).shape[0]

    @property
    def group(self) -> tuple:
        """Jobs of one group may be joined along the batch axis: same bucket on every other axis."""
        assert self.plan is not None
        return tuple(sorted((name, shape[1:]) for name, shape in self.plan.run_shapes.items()))


@dataclass(frozen=True)
class Run:
    outputs: dict[str, np.ndarray]
    engine: str
    bucket: str
    inference_ms: float
    dynamic: bool = False
    """Served by a bucket of the dynamic tier (by its symbolic kernel, or by ONNX Runtime until it has one)."""


def model_weight(registry: Registry, model: str) -> float:
    """A model's share of the inference threads (its config's ``weight``; 1 once it is no longer served)."""
    served = registry.find(model)
    return served.record.config.weight if served is not None else 1.0


class Inference:
    def __init__(
        self,
        registry: Registry,
        kernels: Kernels,
        metrics: Metrics,
        *,
        threads: int,
        queue_size: int,
        inline_max_ms: float,
        threads_per_model: int = 0,
        admission: CompileAdmission,
        cold_lane: bool = False,
        kernel_input_max_abs: float = 1e6,
        shadow: ShadowChecks | None = None,
    ) -> None:
        """``admission`` counts every bucket's hits, is asked about every request to a cold bucket and
        tells new shapes from established ones, which ``cold_lane`` runs at idle priority. Requests with
        float inputs past ``kernel_input_max_abs`` or not finite go to ONNX Runtime. ``shadow`` samples
        the requests kernels answer, to check them against ONNX Runtime."""
        self.shadow = shadow
        self.kernel_input_max_abs = kernel_input_max_abs
        self.registry = registry
        self.kernels = kernels
        self.metrics = metrics
        self.inline_max_ms = inline_max_ms
        self.admission = admission
        self.pool = FairPool(
            threads, "jitserve-infer", max_threads_per_model=threads_per_model,
            weight_of=partial(model_weight, registry), on_start=metrics.serving.record_queue_wait,
        )  # fmt: skip
        self.cold_pool = FairPool(threads, "jitserve-cold", initializer=idle_thread_priority) if cold_lane else None
        self._slots = threading.BoundedSemaphore(threads + queue_size)

    def close(self) -> None:
        for pool in (self.pool, self.cold_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    # -- where a request runs --------------------------------------------

    async def offload(
        self,
        function: Callable[..., T],
        *args: Any,
        model: str | None = None,
        pool: FairPool | None = None,
    ) -> T:
        """``function(*args)`` on the inference threads (or ``pool``); 503 (counted for ``model``) when the
        bounded queue is full."""
        self._take_slot(model)
        try:
            future = (pool or self.pool).submit_as(model or SHARED, contextvars.copy_context().run, function, *args)
        except RuntimeError:
            self._slots.release()
            raise UnavailableError("server is shutting down") from None
        future.add_done_callback(lambda _: self._slots.release())
        return await asyncio.wrap_future(future)

    async def run(self, job: Job) -> Prediction:
        """Run a prepared request where it costs least (see the module's docstring)."""
        batcher, verdicts = job.served.batcher, job.served.batch_verdicts
        group = job.group if batcher is not None and job.plan is not None else None
        if group is not None and (verdicts is None or verdicts.batches(group, job.plan)):
            self._take_slot(job.served.name)
            try:
                future = batcher.submit(job, group=group, rows=job.rows)
            except RuntimeError:  # the version was replaced or unloaded a moment ago
                self._slots.release()
                return await self.offload(self.execute, job, model=job.served.name)
            future.add_done_callback(lambda _: self._slots.release())
            return await asyncio.wrap_future(future)
        if job.plan is not None and (bucket := self._cheap_bucket(job.served, job.plan)) is not None:
            return self.execute(job, bucket)
        return await self.offload(self.execute, job, model=job.served.name, pool=self._pool_for(job))

    def _pool_for(self, job: Job) -> FairPool:
        """The cold lane (idle priority) for a new shape (a bucket that has not earned a compile), else the inference
        threads."""
        if self.cold_pool is None or job.plan is None:
            return self.pool
        if self.admission.established(job.served, job.served.find_bucket(job.plan.bucket)):
            return self.pool
        self.metrics.serving.record_cold_lane(model=job.served.name)
        return self.cold_pool

    def _take_slot(self, model: str | None) -> None:
        if not self._slots.acquire(blocking=False):
            error = UnavailableError("inference pool is full; retry later")
            self.reject(model, error)
            raise error

    def _cheap_bucket(self, served: ServedModel, plan: BucketPlan) -> ServedBucket | None:
        """The plan's bucket when running it on the event loop is cheaper than a hop to a thread: its
        recent runs (so past its first sight) measure below ``inline_max_ms``, and no kernel is to be
        loaded from the store first. None otherwise."""
        bucket = served.find_bucket(plan.bucket)
        if bucket is None or not bucket.runs_below(self.inline_max_ms):
            return None
        key = bucket.serves_kernel_key
        return bucket if key is None or self.kernels.has(served, key) else None

    # -- preparing and running -------------------------------------------

    def prepare(self, served: ServedModel, inputs: Any) -> Job:
        """Parse and plan a request: 400 naming what is wrong."""
        started, protocol = time.perf_counter(), PROTOCOL.get()
        arrays = parse_inputs(served.model.signature, inputs, served.model.index_bounds.ranges)
        if any(array.size == 0 for array in arrays.values()):
            return Job(served, arrays, None, started, protocol)  # nothing to pad, nothing worth a kernel
        if not all(_ordinary(array, self.kernel_input_max_abs) for array in arrays.values()):
            return Job(served, arrays, None, started, protocol)  # the reference answers special values, as sent
        plan = served.planner.plan({k: v.shape for k, v in arrays.items()})
        return Job(served, arrays, plan, started, protocol)

    def execute(self, job: Job, bucket: ServedBucket | None = None) -> Prediction:
        """Run a prepared request here and now; ``bucket``: its plan's bucket, when already looked up."""
        try:
            run = self._run(job.served, job.arrays, job.plan, bucket)
        except JitServeError as exc:
            self.metrics.serving.record_request(
                model=job.served.name, engine="none", code=exc.http_status, protocol=job.protocol
            )
            raise
        return self._answer(job, run.outputs, run)

    def execute_batch(self, jobs: list[Job]) -> list[Prediction | Exception]:
        """Jobs of one group as one run along the batch axis, split back; when the joint run
        fails, each job runs alone so that only the one at fault fails."""
        if len(jobs) > 1:
            served = jobs[0].served
            try:
                joined = _join(jobs, served.record.config.pad_values)
                plan = served.planner.plan({name: array.shape for name, array in joined.items()})
                run = self._run(served, joined, plan)
            except Exception:  # noqa: BLE001 - retried alone below; each job's own error is reported
                pass
            else:
                answers, offset = [], 0
                for job in jobs:
                    rows = {name: out[offset : offset + job.rows] for name, out in run.outputs.items()}
                    answers.append(self._answer(job, served.planner.unpad(rows, job.plan), run))
                    offset += job.rows
                return answers
        return [_result_of(self.execute, job) for job in jobs]

    def _answer(self, job: Job, outputs: dict[str, np.ndarray], run: Run) -> Prediction:
        served = job.served
        self.metrics.serving.record_request(
            model=served.name,
            engine=run.engine,
            code=200,
            seconds=time.perf_counter() - job.started,
            dynamic=run.dynamic,
            protocol=job.protocol,
        )
        return Prediction(
            model=served.name,
            version=served.record.version,
            outputs={k: contiguous(v) for k, v in outputs.items()},
            engine=run.engine,
            bucket=run.bucket,
            inference_ms=run.inference_ms,
        )

    def _run(
        self,
        served: ServedModel,
        arrays: dict[str, np.ndarray],
        plan: BucketPlan | None,
        bucket: ServedBucket | None = None,
    ) -> Run:
        kernel = None
        if plan is None:
            label = bucket_label({k: v.shape for k, v in arrays.items()})
        else:
            bucket = bucket or served.bucket_for(plan.bucket)
            self.admission.record_hit(bucket)
            label, kernel = bucket.label, self._kernel_for(served, bucket, plan)
        if bucket is not None:
            bucket.begin_run()
        inference_ms = None
        started = time.perf_counter()
        try:
            outputs = self._kernel_run(served, bucket, kernel, arrays, plan) if kernel is not None else None
            if outputs is not None:
                engine = bucket.route or "tvm"
                self.metrics.serving.record_padding(model=served.name, waste=plan.padding_waste())
                if self.shadow is not None:
                    self.shadow.offer(served, bucket, engine, arrays, outputs)
            else:
                engine = "onnxruntime"
                outputs = served.ort.run(arrays)
            inference_ms = (time.perf_counter() - started) * 1000
        finally:
            if bucket is not None:
                bucket.observe_run(inference_ms)
        return Run(outputs, engine, label, inference_ms, dynamic=bucket is not None and bucket.symbolic)

    @staticmethod
    def _kernel_run(served: ServedModel, bucket: ServedBucket, kernel: Engine, arrays, plan) -> dict | None:
        """The kernel's outputs; None where a dynamic kernel refused the sizes (its run-time checks of dims
        its model requires to agree): ONNX Runtime then answers, or refuses with its own reason (a 400)."""
        try:
            return served.planner.run_padded(kernel, arrays, plan, served.record.config.pad_values)
        except JitServeError:
            raise
        except Exception as exc:
            if not bucket.symbolic:
                raise
            log.info("%s %s: the dynamic kernel refused the request (%s); onnxruntime takes it", served.name,
                     bucket.label, str(exc).strip().splitlines()[-1:])  # fmt: skip
            return None

    def reject(self, name: str | None, error: JitServeError) -> None:
        """Count a request refused before it ran; only registered names become labels."""
        model = name if isinstance(name, str) and self.registry.find(name) is not None else ""
        self.metrics.serving.record_request(model=model, engine="none", code=error.http_status, protocol=PROTOCOL.get())

    def _kernel_for(self, served: ServedModel, bucket: ServedBucket, plan: BucketPlan) -> Engine | None:
        """The kernel that serves this bucket, or None for ONNX Runtime."""
        if bucket.symbolic:  # before admission counts the bucket itself: its first sizes are no second new shape
            sizes = tuple(sorted((a, n) for a, n in plan.request_axes.items() if isinstance(plan.bucket_axes[a], str)))
            self.admission.note_sizes(served, bucket, sizes)
        if bucket.state is BucketState.COLD:
            self.admission.consider(served, bucket)
            if bucket.state is not BucketState.READY:
                self.metrics.kernels.record_lookup(model=served.name, hit=False)
                return None
        key = bucket.serves_kernel_key
        if key is None:
            return None
        engine = self.kernels.get(served, key)
        self.metrics.kernels.record_lookup(model=served.name, hit=engine is not None)
        if engine is None:  # evicted, or routed by an earlier process
            try:
                engine = self.kernels.load(served, key)
            except JitServeError as exc:
                if not (bucket.route or "").startswith(OPENVINO):
                    raise
                # Rebuilt after an eviction, it no longer builds or verifies: ONNX Runtime serves meanwhile.
                bucket.evict(f"openvino rebuild failed: {exc}")
                return None
            self.metrics.kernels.record_reload(model=served.name)
        return engine


def _ordinary(array: np.ndarray, max_abs: float) -> bool:
    """Finite and within ``max_abs`` (a NaN fails both comparisons); integers always are."""
    if array.dtype.kind != "f":
        return True
    return bool(-max_abs <= array.min() and array.max() <= max_abs)


def _join(jobs: list[Job], pad_values: dict[str, float]) -> dict[str, np.ndarray]:
    """Every job padded to the group's bucket on its other axes, concatenated along dim 0."""
    parts: dict[str, list[np.ndarray]] = {}
    for job in jobs:
        assert job.plan is not None
        target = {name: (job.rows, *shape[1:]) for name, shape in job.plan.run_shapes.items()}
        for name, array in pad_inputs(job.arrays, target, pad_values).items():
            parts.setdefault(name, []).append(array)
    return {name: np.concatenate(arrays) for name, arrays in parts.items()}


def _result_of(function: Callable[[Job], Prediction], job: Job) -> Prediction | Exception:
    try:
        return function(job)
    except Exception as exc:  # noqa: BLE001 - handed to the job's own future
        return exc
