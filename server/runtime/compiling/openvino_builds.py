"""OpenVINO beside ONNX Runtime and TVM: the model compiled once per model version and precision, its
symbolic dims dynamic, and run for each bucket through an infer request of its own. A bucket's engine is
verified against ONNX Runtime like a TVM kernel, timed by the same measurement, and held in the kernel
cache only while it serves; the compiled model (its one copy of the weights) lives while some bucket's
engine holds it, and goes with the last one (a delete, an eviction).

Nothing is stored: a bucket it serves is built again after an eviction or a restart (seconds, where a
TVM kernel reloads in milliseconds), and verified again before it serves. A compile is counted on its
own (``jitserve_openvino_compiles_total``), never as a TVM compile, and only where its memory fits.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from compiler.building.target import target_kind
from compiler.errors import JitServeError
from compiler.models.memory import anonymous_resident_bytes
from compiler.running.openvino_engine import (
    OpenVinoEngine,
    OpenVinoModel,
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
    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        staging: StagingArea,
        *,
        threads: int | None,
        check_room: Callable[[str, int], None] = lambda what, nbytes: None,
    ) -> None:
        """``check_room(what, bytes)`` raises where the server has no room for ``bytes`` more (memory-aware
        admission): a model compiled by OpenVINO holds about its weights again."""
        self.settings = settings
        self.staging = staging
        self.metrics = metrics
        self.threads = threads
        self.check_room = check_room
        self.enabled = settings.openvino and openvino_available()
        """OpenVINO is measured on every bucket OpenVINO can take: enabled by the settings, and installed."""
        # (model version digest, precision) -> its compiled model, while some bucket's engine holds it.
        self._models: weakref.WeakValueDictionary[tuple[str, str], OpenVinoModel] = weakref.WeakValueDictionary()
        self._compiling = threading.Lock()  # one compile at a time: a second bucket waits for the first's model

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

    def model(self, served: ServedModel, precision: str) -> OpenVinoModel:
        """The version's model compiled by OpenVINO in ``precision``: the one its buckets' engines hold, else
        compiled now (timed and counted as an OpenVINO compile) where the server has room for it."""
        with self._compiling:
            key = (served.record.digest, precision)
            found = self._models.get(key)
            if found is not None:
                return found
            started = time.perf_counter()
            try:
                self.check_room(f"openvino for model {served.name!r}", served.model.weight_bytes)
                model = OpenVinoModel(
                    served.model.read_bytes(), threads=self.threads, ir_dir=self.staging.entry("openvino"),
                    precision=precision,
                )  # fmt: skip
            except JitServeError:
                self.metrics.compiles.record_openvino_compile(
                    model=served.name, precision=precision, outcome="error", seconds=time.perf_counter() - started
                )
                raise
            seconds = time.perf_counter() - started
            self.metrics.compiles.record_openvino_compile(
                model=served.name, precision=precision, outcome="ok", seconds=seconds
            )
            log.info("compiled %s for %s in %.1fs (%.0f MiB)", model.name, served.name, seconds, model.nbytes / 2**20)
            self._models[key] = model
            return model

    def build(self, served: ServedModel, bucket: ServedBucket, precision: str = "f32") -> OpenVinoBuild:
        """OpenVINO in ``precision`` for the bucket (the version's compiled model, an infer request of the
        bucket's), verified (a reduced precision within the contract's budget)."""
        name = engine_name(precision)
        started = time.perf_counter()
        engine, detail, outcome = self._build(served, bucket, precision)
        seconds = time.perf_counter() - started
        self.metrics.compiles.record_openvino_build(model=served.name, engine=name, outcome=outcome)
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
            "model_bytes": engine.model.nbytes,
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
            model = self.model(served, precision)
            before = anonymous_resident_bytes()
            engine = model.engine(dict(bucket.bucket), served.model.signature.output_names)
            # Judged as the padding gate and the shadow checks judge it: by the contract's budget where it has one.
            verified, detail = verify_openvino(
                engine, served.ort, bucket.bucket, served.dtypes, seed=served.options.seed,
                index_limits=served.model.index_bounds.limits, compare=partial(served.compare, name),
            )  # fmt: skip
            # Its request's intermediates, and any weights OpenVINO packed anew for its shapes on its first run
            # (BERT-base: 0.32x its weights again for the first bucket of 64 rows or fewer), which the model keeps.
            engine.nbytes = max(0, anonymous_resident_bytes() - before)
            model.grown += engine.nbytes
        except JitServeError as exc:
            return None, f"{name}: {exc}", "error"
        if not verified:
            against = "onnxruntime within the precision contract's budget" if budget else "onnxruntime"
            return None, f"{name}: verification against {against}: {detail}", "verify_failed"
        return engine, detail, "ok"

    def held_bytes(self, served: ServedModel) -> int:
        """What the version's compiled models hold (in every precision), while some bucket's engine holds them."""
        models = list(self._models.items())  # a copy: entries go as their last engine does
        return sum(model.nbytes + model.grown for (digest, _), model in models if digest == served.record.digest)
