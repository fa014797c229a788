"""Routing again once requests run side by side.

A bucket compiled before its load came was routed by one request's latency, which favours a kernel using
every core (TVM, OpenVINO) over ONNX Runtime on one thread. Under concurrent load that is the wrong
measure: two single-threaded ONNX Runtime calls run in parallel, two kernels that each want every core
take turns (measured: PP-OCR cls under 32 connections served 725 req/s routed to OpenVINO, 1,266-1,494
on ONNX Runtime). So once a bucket's requests have kept starting beside one another, its engine is
measured again by throughput at that concurrency, against ONNX Runtime, and the faster one serves it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from compiler.running.engines import Engine

from ...settings import Settings
from ..memory.kernel_cache import Kernels
from ..models.periodic import Periodic
from ..models.registry import ServedModel
from ..models.state import BucketState, ServedBucket
from .router import Router, held_apart

log = logging.getLogger("jitserve")

OVERLAPPED_RUNS_TO_REROUTE = 16
"""Runs of a bucket started while another of its runs was going, before it is measured again: a sustained
load, not two requests that met once."""

COMPILED_TIERS = ("tvm", "tvm-tuned")
"""The bucket's TVM kernels, timed beside the engine serving it where loaded."""


class Rerouter:
    def __init__(
        self,
        settings: Settings,
        served_models: Callable[[], list[ServedModel]],
        kernels: Kernels,
        router: Router,
        *,
        interval: float = 1.0,
    ) -> None:
        self.settings = settings
        self._served_models = served_models
        self.kernels = kernels
        self.router = router
        self._periodic = Periodic("reroute", self.reroute_due, interval, at_start=False)

    def start(self) -> None:
        self._periodic.start()

    def stop(self) -> None:
        self._periodic.stop()

    def due(self) -> list[tuple[ServedModel, ServedBucket]]:
        """Buckets served by a kernel chosen by latency whose requests now run side by side."""
        if self.settings.routing != "measured" or self.settings.inference_threads < 2:
            return []  # nothing to choose, or no two requests ever run at once
        return [
            (served, bucket)
            for served in self._served_models()
            if not served.retired
            for bucket in served.all_buckets()
            if bucket.state is BucketState.READY
            and bucket.routed_by == "latency"
            and bucket.route not in (None, "onnxruntime")
            and bucket.overlapped_runs >= OVERLAPPED_RUNS_TO_REROUTE
        ]  # a bucket being tuned too: its tuning takes a minute, and routes it again (by throughput) as it ends

    def reroute_due(self) -> int:
        """Measure and route every due bucket again; returns how many changed engine."""
        changed = 0
        for served, bucket in self.due():
            try:
                changed += self.reroute(served, bucket)
            except Exception:  # one bucket's failure leaves the others to be measured
                log.exception("%s %s: routing again by throughput failed", served.name, bucket.label)
            bucket.overlapped_runs = 0  # whatever came of it, due again only after as many overlaps
        return changed

    def reroute(self, served: ServedModel, bucket: ServedBucket) -> bool:
        """The bucket's engine and its other loaded compiled kernels against ONNX Runtime, by throughput at
        the concurrency it has seen; True if another engine serves it now."""
        serving = bucket.route or ""
        candidates: dict[str, Engine] = {}
        for tier in {*COMPILED_TIERS, serving}:
            key = bucket.key_for(tier)
            held = self.kernels.get(served, key) if key is not None and key not in bucket.demoted else None
            if held is not None:
                # A kernel is timed as a fresh instance (its live one keeps serving), a tier held apart as held.
                candidates[tier] = held if held_apart(tier) else self.kernels.open(served, key)
        if serving not in candidates:
            return False  # evicted or demoted meanwhile: it is routed when it is loaded again
        routed = self.router.route(served, bucket, candidates)
        log.info("%s %s: its requests run side by side; routed again by throughput: %s -> %s",
                 served.name, bucket.label, serving, routed)  # fmt: skip
        if routed != serving and held_apart(serving):
            self.kernels.drop(served, bucket.key_for(serving))  # measured slower: its memory goes back
        return routed != serving
