"""Routing: time every verified engine on a bucket and serve it with the
fastest; persist the route, and restore it after a restart without a
compile or a re-measure."""

from __future__ import annotations

import logging

import numpy as np

from compiler.arrays import compare_outputs, random_inputs
from compiler.buckets import BucketPlan, BucketPlanner
from compiler.engines import Engine
from compiler.store import ArtifactStore
from compiler.timing import median_latencies_ms, requests_per_second

from ..settings import Settings
from .metrics import Metrics
from .records import BucketRecord, ModelStore
from .registry import ServedModel
from .state import ServedBucket

log = logging.getLogger("jitserve")


class ServingKernel:
    """A kernel as serving runs it: pad the request to the bucket, run, cut the outputs back."""

    def __init__(self, kernel: Engine, planner: BucketPlanner, plan: BucketPlan, pad_values: dict[str, float]) -> None:
        self.name = kernel.name
        self.kernel = kernel
        self.planner = planner
        self.plan = plan
        self.pad_values = pad_values

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.planner.run_padded(self.kernel, inputs, self.plan, self.pad_values)


class Router:
    def __init__(self, settings: Settings, metrics: Metrics, models: ModelStore, artifacts: ArtifactStore) -> None:
        self.settings = settings
        self.metrics = metrics
        self.models = models
        self.artifacts = artifacts

    def route(self, served: ServedModel, bucket: ServedBucket, kernels: dict[str, Engine]) -> str:
        """Time ONNX Runtime and ``kernels`` as they serve a request of the bucket, serve it with the
        chosen engine, persist.

        The request is a typical one of the bucket: ONNX Runtime runs it as sent, every kernel with
        its pad and cut-back. ``kernels`` are private instances, so a kernel serving live traffic
        is not timed while it waits for its own requests.
        """
        inputs, engines = self._serving(served, bucket, kernels, served.planner.typical_request(bucket.bucket))
        timed = {"onnxruntime": served.ort, **engines}
        latency = median_latencies_ms(timed, inputs, warmup=2, runs=self.settings.routing_runs)
        errors = self._padded_errors(served, bucket, kernels)
        tolerance = served.planner.approximate_tolerance(bucket.bucket)
        allowed = ["onnxruntime"] + [e for e in kernels if tolerance is None or errors[e] <= tolerance]
        throughput = None
        concurrency = min(bucket.peak_concurrency, self.settings.inference_threads)
        if self.settings.routing == "compiled":
            route = next((e for e in ("tvm-tuned", "tvm") if e in allowed), "onnxruntime")
        elif concurrency >= 2 and len(allowed) > 1:
            # Requests arrive side by side: one request's latency would favour a kernel that uses
            # every core over ONNX Runtime sessions that serve callers in parallel.
            throughput = requests_per_second(
                {e: timed[e] for e in allowed}, inputs, concurrency=concurrency, runs=self.settings.routing_runs
            )
            route = max(allowed, key=throughput.get)
        else:
            route = min(allowed, key=latency.get)
        bucket.serve(route, latency, padded_error=errors, throughput_rps=throughput)
        self.metrics.record_routing(model=served.name, engine=route)
        log.info(
            "routed %s %s to %s by %s (%s ms, %s req/s)",
            served.name,
            bucket.label,
            route,
            bucket.routed_by,
            bucket.latency_ms,
            bucket.throughput_rps,
        )
        self.remember(served, bucket)
        return route

    def _serving(
        self, served: ServedModel, bucket: ServedBucket, kernels: dict[str, Engine], shapes: dict
    ) -> tuple[dict[str, np.ndarray], dict[str, ServingKernel]]:
        """Seeded inputs of ``shapes`` (a request the bucket serves) and the kernels as serving runs them."""
        inputs = random_inputs(shapes, served.dtypes, self.settings.verify_seed + 1, served.model.index_bounds.limits)
        plan = served.planner.plan({name: array.shape for name, array in inputs.items()})
        pad_values = served.record.config.pad_values
        return inputs, {name: ServingKernel(k, served.planner, plan, pad_values) for name, k in kernels.items()}

    def _padded_errors(self, served: ServedModel, bucket: ServedBucket, kernels: dict[str, Engine]) -> dict:
        """Each kernel's largest difference from ONNX Runtime on the bucket's most padded request."""
        inputs, engines = self._serving(served, bucket, kernels, served.planner.most_padded_request(bucket.bucket))
        reference = served.ort.run(inputs)
        s = self.settings
        return {
            name: compare_outputs(engine.run(inputs), reference, s.verify_rtol, s.verify_atol).max_abs_error
            for name, engine in engines.items()
        }

    def restore(self, served: ServedModel, bucket: ServedBucket) -> bool:
        """A bucket routed by an earlier process keeps its measured route (no compile, no re-measure)."""
        known = served.record.buckets.get(bucket.label)
        if known is None or known.key != bucket.key or known.route is None:
            return False
        bucket.set_tuning(known.tuning, tuned_key=known.tuned_key)
        routed_key = bucket.key_for(known.route)
        manifest = self.artifacts.get(routed_key) if routed_key else None
        if known.route != "onnxruntime" and (manifest is None or manifest.verified is not True):
            return False
        if known.route != "onnxruntime" and not self.artifacts.has_prepared(served.model.digest):
            return False  # a new version of the graph: its compile prepares the weights, then restores
        compiled = self.artifacts.get(bucket.key)
        bucket.serve(
            known.route,
            known.latency_ms,
            compile_seconds=compiled.compile_seconds if compiled else None,
            padded_error=known.padded_error,
            throughput_rps=known.throughput_rps,
        )
        return True

    def remember(self, served: ServedModel, bucket: ServedBucket) -> None:
        """Persist what a restart needs: keys, measured latencies, the route, tuning."""
        if served.retired:
            return
        served.record.buckets[bucket.label] = BucketRecord(
            key=bucket.key,
            model_version=served.record.version,
            latency_ms=bucket.latency_ms,
            throughput_rps=bucket.throughput_rps,
            padded_error=bucket.padded_error,
            route=bucket.route,
            tuned_key=bucket.tuned_key,
            tuning=bucket.tuning,
            history=bucket.history,
        )
        self.models.update_bucket(served.record, bucket.label)
