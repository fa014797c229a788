"""OpenVINO per bucket, beside ONNX Runtime and TVM: built for a bucket as it is routed, verified
against ONNX Runtime like a TVM kernel, timed by the same measurement, and held in the kernel cache
(its own copy of the weights counted in the cache's bytes) only while it serves.

Nothing is stored: a bucket it serves is built again after an eviction or a restart (seconds, where a
TVM kernel reloads in milliseconds), and verified again before it serves.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass

from compiler.errors import JitServeError
from compiler.openvino_engine import OpenVinoEngine, openvino_available, openvino_version, verify_openvino
from compiler.store import StagingArea
from compiler.target import target_kind

from ..settings import Settings
from .metrics import Metrics
from .registry import ServedModel
from .state import ServedBucket

log = logging.getLogger("jitserve")

OPENVINO = "openvino"
"""The engine's name in routes, latencies, metrics and reports."""
KEY_PREFIX = "openvino-"


@dataclass(frozen=True)
class OpenVinoBuild:
    """A bucket's OpenVINO: the engine where it verified, else None and why."""

    engine: OpenVinoEngine | None
    failure: str | None
    seconds: float


class OpenVinoBuilds:
    def __init__(self, settings: Settings, metrics: Metrics, staging: StagingArea, *, threads: int | None) -> None:
        self.settings = settings
        self.staging = staging
        self.metrics = metrics
        self.threads = threads
        self.enabled = settings.openvino and openvino_available()
        """OpenVINO is measured on every bucket OpenVINO can take: enabled by the settings, and installed."""

    def takes(self, served: ServedModel, bucket: ServedBucket) -> bool:
        """Built for CPU buckets of static shapes (a dynamic bucket's kernel covers a range of sizes)."""
        return self.enabled and target_kind(served.target) == "llvm" and not bucket.symbolic

    def key(self, served: ServedModel, bucket: ServedBucket) -> str:
        """What its build is made of: the model version's bytes, the bucket, OpenVINO's version and its
        threads. A shadow check's demotion keeps this key off the bucket."""
        made_of = f"{served.record.digest} {bucket.label} {openvino_version()} {self.threads} f32"
        return KEY_PREFIX + hashlib.sha256(made_of.encode()).hexdigest()

    def build(self, served: ServedModel, bucket: ServedBucket) -> OpenVinoBuild:
        """Build and verify OpenVINO for the bucket; the build is counted as the ``openvino`` tier's compile."""
        started = time.perf_counter()
        engine, detail, outcome = self._build(served, bucket)
        seconds = time.perf_counter() - started
        self.metrics.record_compile(model=served.name, target="llvm", tier=OPENVINO, outcome=outcome, seconds=seconds)
        if engine is None:
            log.warning("%s %s: %s", served.name, bucket.label, detail)
            bucket.openvino = {"failure": detail}
            return OpenVinoBuild(None, detail, seconds)
        log.info("built openvino %s %s in %.1fs (%.0f MiB)", served.name, bucket.label, seconds, engine.nbytes / 2**20)
        bucket.openvino = {
            "key": self.key(served, bucket),
            "build_seconds": round(seconds, 2),
            "bytes": engine.nbytes,
            "verification": detail,
        }
        return OpenVinoBuild(engine, None, seconds)

    def _build(self, served: ServedModel, bucket: ServedBucket) -> tuple[OpenVinoEngine | None, str, str]:
        """The verified engine (or None), the verification's detail (or why it failed), and the outcome."""
        options = served.options
        try:
            engine = OpenVinoEngine(
                served.model.read_bytes(), dict(bucket.bucket), served.model.signature.output_names,
                threads=self.threads, ir_dir=self.staging.entry("openvino"),
            )  # fmt: skip
            verified, detail = verify_openvino(
                engine, served.ort, bucket.bucket, served.dtypes, rtol=options.rtol, atol=options.atol,
                seed=options.seed, index_limits=served.model.index_bounds.limits, steps=served.model.output_steps,
            )  # fmt: skip
        except JitServeError as exc:
            return None, f"openvino: {exc}", "error"
        if not verified:
            return None, f"openvino: verification against onnxruntime: {detail}", "verify_failed"
        return engine, detail, "ok"
