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
from functools import partial

from compiler.building.target import target_kind
from compiler.errors import JitServeError
from compiler.running.openvino_engine import (
    OpenVinoEngine,
    engine_name,
    openvino_available,
    openvino_version,
    verify_openvino,
)
from compiler.running.precision import budget_for
from compiler.storage.store import StagingArea

from ...settings import Settings
from ..models.registry import ServedModel
from ..models.state import ServedBucket
from ..observability.metrics import Metrics

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

    @staticmethod
    def precisions(served: ServedModel) -> list[str]:
        """fp32, then each reduced precision the model's precision contract allows."""
        contract = served.record.config.precision
        return ["f32", *dict.fromkeys(p for p in (contract.allow if contract else []) if p != "int8")]

    def key(self, served: ServedModel, bucket: ServedBucket, precision: str = "f32") -> str:
        """What its build is made of: the model version's bytes, the bucket, OpenVINO's version, its threads
        and precision (with the contract's budget it was verified within). A shadow check's demotion keeps
        this key off the bucket."""
        contract = served.record.config.precision
        budget = budget_for(engine_name(precision), contract, bool(served.model.integer_ops))
        budget = budget.model_dump_json() if budget else ""
        made_of = f"{served.record.digest} {bucket.label} {openvino_version()} {self.threads} {precision} {budget}"
        return KEY_PREFIX + hashlib.sha256(made_of.encode()).hexdigest()

    def build(self, served: ServedModel, bucket: ServedBucket, precision: str = "f32") -> OpenVinoBuild:
        """Build and verify OpenVINO in ``precision`` for the bucket (a reduced one within the contract's
        budget); the build is counted as the compile of its engine's tier (``openvino``, ``openvino-bf16``)."""
        name = engine_name(precision)
        started = time.perf_counter()
        engine, detail, outcome = self._build(served, bucket, precision)
        seconds = time.perf_counter() - started
        self.metrics.compiles.record_compile(
            model=served.name, target="llvm", tier=name, outcome=outcome, seconds=seconds
        )
        if engine is None:
            log.warning("%s %s: %s", served.name, bucket.label, detail)
            bucket.openvino = {**(bucket.openvino or {}), name: {"precision": precision, "failure": detail}}
            return OpenVinoBuild(None, detail, seconds)
        log.info("built %s %s %s in %.1fs (%.0f MiB)", name, served.name, bucket.label, seconds, engine.nbytes / 2**20)
        facts = {
            "key": self.key(served, bucket, precision),
            "precision": precision,
            "build_seconds": round(seconds, 2),
            "bytes": engine.nbytes,
            "verification": detail,
        }
        bucket.openvino = {**(bucket.openvino or {}), name: facts}
        return OpenVinoBuild(engine, None, seconds)

    def _build(
        self, served: ServedModel, bucket: ServedBucket, precision: str
    ) -> tuple[OpenVinoEngine | None, str, str]:
        """The verified engine (or None), the verification's detail (or why it failed), and the outcome."""
        name = engine_name(precision)
        budget = budget_for(name, served.record.config.precision, bool(served.model.integer_ops))
        try:
            engine = OpenVinoEngine(
                served.model.read_bytes(), dict(bucket.bucket), served.model.signature.output_names,
                threads=self.threads, ir_dir=self.staging.entry("openvino"), precision=precision,
            )  # fmt: skip
            # Judged as the padding gate and the shadow checks judge it: by the contract's budget where it has one.
            verified, detail = verify_openvino(
                engine, served.ort, bucket.bucket, served.dtypes, seed=served.options.seed,
                index_limits=served.model.index_bounds.limits, compare=partial(served.compare, name),
            )  # fmt: skip
        except JitServeError as exc:
            return None, f"{name}: {exc}", "error"
        if not verified:
            against = "onnxruntime within the precision contract's budget" if budget else "onnxruntime"
            return None, f"{name}: verification against {against}: {detail}", "verify_failed"
        return engine, detail, "ok"
