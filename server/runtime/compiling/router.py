"""Routing: time every verified engine on a bucket and serve it with the
fastest; persist the route, and restore it after a restart without a
compile or a re-measure."""

from __future__ import annotations

import logging
import threading

import numpy as np

from compiler.building.worker import children_paused
from compiler.measuring.timing import median_latencies_ms, requests_per_second
from compiler.running.arrays import random_inputs
from compiler.running.engines import Engine
from compiler.shapes.buckets import BucketPlan, BucketPlanner, bucket_label
from compiler.shapes.padding import check_axis_padding
from compiler.storage.store import KernelStore

from ...settings import Settings
from ..models.records import BucketRecord, ModelStore
from ..models.registry import ServedModel
from ..models.state import BF16_TIER, ServedBucket
from ..observability.metrics import Metrics
from .openvino_builds import OPENVINO

log = logging.getLogger("jitserve")


def held_apart(engine: str) -> bool:
    """A tier held as it was built (OpenVINO's builds, the bf16 kernel), beside the bucket's TVM kernels: timed
    as it is held, and dropped when another engine wins the bucket (its memory goes back)."""
    return engine.startswith(OPENVINO) or engine == BF16_TIER


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
    def __init__(self, settings: Settings, metrics: Metrics, models: ModelStore, artifacts: KernelStore) -> None:
        self.settings = settings
        self.metrics = metrics
        self.models = models
        self.artifacts = artifacts
        self._routing = threading.Lock()
        """One routing at a time (a compile's, tuning's, a re-route's): engines are not timed against
        each other's measurements, and one bucket's routes do not cross."""

    def route(
        self, served: ServedModel, bucket: ServedBucket, kernels: dict[str, Engine], *, unavailable: str | None = None
    ) -> str:
        """Time ONNX Runtime and ``kernels`` as they serve a request of the bucket, serve it with the
        chosen engine, persist. ``unavailable``: why an engine that might have been among them is not (the
        bucket's reason keeps it).

        The request is a typical one of the bucket: ONNX Runtime runs it as sent, every kernel with
        its pad and cut-back. ``kernels`` are private instances, so a kernel serving live traffic
        is not timed while it waits for its own requests.
        """
        with self._routing:
            return self._route(served, bucket, kernels, unavailable)

    def _route(
        self, served: ServedModel, bucket: ServedBucket, kernels: dict[str, Engine], unavailable: str | None
    ) -> str:
        inputs, engines = self._serving(served, bucket, kernels, served.planner.typical_request(bucket.bucket))
        timed = {"onnxruntime": served.ort, **engines}
        with children_paused() as paused:  # other buckets' compiles and tuning wait: a fair measurement
            latency = median_latencies_ms(timed, inputs, warmup=2, runs=self.settings.routing_runs)
        errors, refused = self._padding_gate(served, bucket, kernels)
        demoted = {e for e in kernels if bucket.key_for(e) in bucket.demoted}  # never again, whatever it measures
        allowed = ["onnxruntime"] + [e for e in kernels if e not in refused and e not in demoted]
        throughput = None
        concurrency = min(bucket.peak_concurrency, self.settings.inference_threads)
        if self.settings.routing == "compiled":
            route = next((e for e in (BF16_TIER, "tvm-tuned", "tvm", "openvino") if e in allowed), "onnxruntime")
        elif concurrency >= 2 and len(allowed) > 1:
            # Requests arrive side by side: one request's latency would favour a kernel that uses
            # every core over ONNX Runtime sessions that serve callers in parallel.
            with children_paused():
                throughput = requests_per_second(
                    {e: timed[e] for e in allowed}, inputs, concurrency=concurrency, runs=self.settings.routing_runs
                )
            route = max(allowed, key=throughput.get)
        else:
            route = min(allowed, key=latency.get)
        reason = "; ".join(([unavailable] if unavailable else []) + list(refused.values())) or None
        bucket.serve(route, latency, padded_error=errors, throughput_rps=throughput, reason=reason)
        self.metrics.compiles.record_routing(model=served.name, engine=route)
        log.info(
            "routed %s %s to %s by %s (%s ms, %s req/s; %d compile processes paused while timed)",
            served.name,
            bucket.label,
            route,
            bucket.routed_by,
            bucket.latency_ms,
            bucket.throughput_rps,
            paused,
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

    def _padding_gate(
        self, served: ServedModel, bucket: ServedBucket, kernels: dict[str, Engine]
    ) -> tuple[dict[str, float], dict[str, str]]:
        """Each kernel's largest difference from ONNX Runtime on the bucket's most padded request (padded,
        run and cut back by the kernel; run exactly by ONNX Runtime), and the kernels that may not serve
        for it, with why: beyond the model's verification tolerance, or an ``approximate`` axis's.

        A second guard beside the padding probe, whatever the axes' verdicts. A refusal on a bucket that
        pads also revises the verdict of each axis whose padding changes ONNX Runtime's own outputs at
        this bucket's sizes, for every bucket of the model."""
        shapes = served.planner.most_padded_request(bucket.bucket)
        inputs, engines = self._serving(served, bucket, kernels, shapes)
        reference = served.ort.run(inputs)
        tolerance = served.planner.approximate_tolerance(bucket.bucket)
        errors, refused = {}, {}
        for name, engine in engines.items():
            comparison = served.compare(name, engine.run(inputs), reference)
            errors[name] = comparison.max_abs_error
            if comparison.matches or (tolerance is not None and comparison.max_abs_error <= tolerance):
                continue
            request = bucket_label({k: v.shape for k, v in inputs.items()})
            refused[name] = f"padding gate: {name} not routed, {comparison.detail} on request {request}"
            log.warning("model %s bucket %s: %s", served.name, bucket.label, refused[name])
        if refused:
            revised = self._revise_verdicts(served, bucket, inputs)
            self.metrics.correctness.record_gate_refusal(model=served.name, revised_axes=revised)
        return errors, refused

    def _revise_verdicts(self, served: ServedModel, bucket: ServedBucket, inputs: dict[str, np.ndarray]) -> int:
        """Each axis this bucket pads is checked with ONNX Runtime at the request's sizes padded to the
        bucket's; one whose padding changes the outputs is unsafe from now on, stored with the reason.
        Returns how many were revised."""
        plan = served.planner.plan({name: array.shape for name, array in inputs.items()})
        options = served.options
        revised = {}
        for axis, size in plan.padded_axes.items():
            if served.planner.effective_policy(axis).approximate is not None:
                continue  # its padding changes the outputs by design, within its own tolerance
            verdict = check_axis_padding(
                served.ort,
                served.model.signature,
                axis,
                plan.request_axes,
                plan.bucket_axes[axis],
                pad_values=served.record.config.pad_values,
                rtol=options.rtol,
                atol=options.atol,
                seed=options.seed,
                index_limits=served.model.index_bounds.limits,
            )
            if verdict.safe or verdict.probe_failed:
                continue
            padded = plan.bucket_axes[axis]
            reason = f"revised by the padding gate on bucket {bucket.label}: at {size} -> {padded}, {verdict.reason}"
            revised[axis] = verdict.model_copy(update={"reason": reason})
        if not revised or served.retired:
            return 0
        served.revise_safety(revised)
        self.models.update_fields(served.record, "safety")
        for axis, verdict in revised.items():
            log.warning("model %s axis %r: %s", served.name, axis, verdict.reason)
        return len(revised)

    def demote(self, served: ServedModel, bucket: ServedBucket, engine: str, reason: str) -> bool:
        """Take ``engine``'s kernel off the bucket for good (a restart keeps it off; a new compile, with a key
        of its own, may serve again): ONNX Runtime serves the bucket. False if ``engine`` no longer served it."""
        if not bucket.demote(engine, reason):
            return False
        self.remember(served, bucket)
        return True

    def restore(self, served: ServedModel, bucket: ServedBucket) -> bool:
        """A bucket routed by an earlier process keeps its measured route (no compile, no re-measure)."""
        known = served.record.buckets.get(bucket.label)
        if known is None or known.key != bucket.key or known.route is None:
            return False
        if known.route == BF16_TIER and self.settings.tvm_bf16 == "off":
            return False  # turned off since: routed again among the rest
        bucket.set_tuning(known.tuning, tuned_key=known.tuned_key)
        bucket.bf16 = known.bf16
        routed_key = bucket.key_for(known.route)
        manifest = self.artifacts.get(routed_key) if routed_key else None
        if known.route != "onnxruntime" and (manifest is None or manifest.verified is not True):
            return False  # OpenVINO's too: nothing of it is stored, so it is built, verified and measured again
        if known.route != "onnxruntime" and not self.artifacts.has_prepared(served.model.digest):
            return False  # a new version of the graph: its compile prepares the weights, then restores
        compiled = self.artifacts.get(bucket.key)
        bucket.serve(
            known.route,
            known.latency_ms,
            compile_seconds=compiled.compile_seconds if compiled else None,
            padded_error=known.padded_error,
            throughput_rps=known.throughput_rps,
            reason=known.reason,
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
            reason=bucket.reason,
            demoted=bucket.demoted,
            tuned_key=bucket.tuned_key,
            tuning=bucket.tuning,
            bf16=bucket.bf16,
            history=bucket.history,
        )
        self.models.update_bucket(served.record, bucket.label)
