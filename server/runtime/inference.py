"""The prediction path: parse the inputs, pick the bucket, run its kernel
(pad, run, cut back) or ONNX Runtime, and account for every request.

Predictions run on a bounded thread pool so that the event loop never
blocks on a kernel; past its queue requests answer 503.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from compiler.arrays import contiguous
from compiler.buckets import bucket_label
from compiler.engines import Engine
from compiler.errors import JitServeError, NotFoundError, UnavailableError

from .inputs import parse_inputs
from .kernel_cache import Kernels
from .metrics import Metrics
from .registry import Registry, ServedModel
from .state import BucketState, ServedBucket


@dataclass(frozen=True)
class Prediction:
    model: str
    version: int
    outputs: dict[str, np.ndarray]
    engine: str
    bucket: str
    inference_ms: float
    """The engine's share of the request (pad, run, cut back), in milliseconds."""

    def body(self) -> dict[str, Any]:
        """The response body: everything but the timing, which travels as a header."""
        return {
            "model": self.model,
            "version": self.version,
            "outputs": self.outputs,
            "engine": self.engine,
            "bucket": self.bucket,
        }


class Inference:
    def __init__(
        self,
        registry: Registry,
        kernels: Kernels,
        metrics: Metrics,
        *,
        threads: int,
        queue_size: int,
        first_sight: Callable[[ServedModel, ServedBucket], None],
    ) -> None:
        """``first_sight`` is called for a bucket seen in state ``new``: restore its route or queue a compile."""
        self.registry = registry
        self.kernels = kernels
        self.metrics = metrics
        self._first_sight = first_sight
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, "jitserve-infer")
        self._slots = threading.BoundedSemaphore(threads + queue_size)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def submit(self, name: str, inputs: Any) -> concurrent.futures.Future[Prediction]:
        """Run :meth:`predict` on the bounded inference pool; 503 when it is full."""
        if not self._slots.acquire(blocking=False):
            raise UnavailableError("inference pool is full; retry later")
        try:
            future = self._pool.submit(self.predict, name, inputs)
        except RuntimeError:
            self._slots.release()
            raise UnavailableError("server is shutting down") from None
        future.add_done_callback(lambda _: self._slots.release())
        return future

    def reject(self, name: str | None, error: JitServeError) -> None:
        """Count a request refused before it reached a model; only registered names become labels."""
        model = name if isinstance(name, str) and self.registry.find(name) is not None else ""
        self.metrics.record_request(model=model, engine="none", code=error.http_status)

    def predict(self, name: str, inputs: Any) -> Prediction:
        started = time.perf_counter()
        served = self.registry.find(name)
        if served is None:
            self.metrics.record_request(model="", engine="none", code=404)
            raise NotFoundError(f"model {name!r} not found")
        engine_name = "none"
        try:
            arrays = parse_inputs(served.model.signature, inputs, served.model.index_bounds.ranges)
            if any(array.size == 0 for array in arrays.values()):
                # No bucket for a zero-size input (nothing to pad, nothing worth a kernel).
                label, kernel = bucket_label({k: v.shape for k, v in arrays.items()}), None
            else:
                plan = served.planner.plan({k: v.shape for k, v in arrays.items()})
                bucket = served.bucket_for(plan.bucket)
                bucket.record_hit()
                label, kernel = bucket.label, self._kernel_for(served, bucket)
            inference_started = time.perf_counter()
            if kernel is not None:
                engine_name = bucket.route or "tvm"
                outputs = served.planner.run_padded(kernel, arrays, plan, served.record.config.pad_values)
                self.metrics.record_padding(model=name, waste=plan.padding_waste())
            else:
                engine_name = "onnxruntime"
                outputs = served.ort.run(arrays)
            inference_ms = (time.perf_counter() - inference_started) * 1000
        except JitServeError as exc:
            self.metrics.record_request(model=name, engine=engine_name, code=exc.http_status)
            raise
        self.metrics.record_request(model=name, engine=engine_name, code=200, seconds=time.perf_counter() - started)
        return Prediction(
            model=name,
            version=served.record.version,
            outputs={k: contiguous(v) for k, v in outputs.items()},
            engine=engine_name,
            bucket=label,
            inference_ms=inference_ms,
        )

    def _kernel_for(self, served: ServedModel, bucket: ServedBucket) -> Engine | None:
        """The kernel that serves this bucket, or None for ONNX Runtime."""
        if bucket.state is BucketState.NEW:
            self._first_sight(served, bucket)
            if bucket.state is not BucketState.READY:
                self.metrics.record_cache_lookup(model=served.name, hit=False)
                return None
        key = bucket.serves_kernel_key
        if key is None:
            return None
        engine = self.kernels.get(key)
        self.metrics.record_cache_lookup(model=served.name, hit=engine is not None)
        if engine is None:  # evicted, or routed by an earlier process
            engine = self.kernels.load(key, served.model.signature, served.target)
            self.metrics.record_reload(model=served.name)
        return engine
