"""Upload -> served model: validate the bytes and the config, build the
served model, store it, serve it through ONNX Runtime; then, in the
background, check which axes padding may change and queue its warm buckets
(:mod:`.padding_probes`). Also brings back the stored models at start."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from compiler.building.build import bucket_key
from compiler.errors import BadRequestError, ConflictError, JitServeError, NotFoundError, UnavailableError
from compiler.models.memory import check_sizes_fit
from compiler.models.model import LoadedModel, load_model
from compiler.running.engines import OrtEngine
from compiler.shapes.buckets import AxisSafety, BucketPlanner
from compiler.shapes.padding import PROBE_VERSION, policy_verdicts

from ...settings import Settings
from ..compiling.compile_admission import WAITING_FOR_VERDICTS
from ..compiling.scheduler import CompileScheduler
from ..memory.memory_guard import MemoryGuard
from ..observability.metrics import Metrics
from ..serving.batch_verdicts import BatchVerdicts
from ..serving.batcher import DynamicBatcher, DynamicBatching, find_batch_axis
from .model_checks import (
    assumed_padding_safe,
    check_served_sizes,
    check_warm_sizes,
    compile_options,
    model_target,
    open_onnxruntime,
    parse_config,
    warm_buckets,
    warm_sizes,
)
from .padding_probes import PaddingProbes
from .records import UNPROBED, ModelRecord, ModelStore, check_model_name
from .registry import PaddingProbe, Registry, ServedModel

log = logging.getLogger("jitserve")

BatcherFactory = Callable[[ServedModel, DynamicBatching, set[int]], DynamicBatcher]


class ModelAdmission:
    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        models: ModelStore,
        scheduler: CompileScheduler,
        *,
        kernel_threads: int,
        tuning_database_dir: Path,
        start_batcher: BatcherFactory,
        memory_guard: MemoryGuard,
        metrics: Metrics,
    ) -> None:
        """``start_batcher`` gives a model with a usable batch axis its dynamic batcher; ``memory_guard``
        refuses uploads that would not fit in memory."""
        self.settings = settings
        self.registry = registry
        self.models = models
        self.scheduler = scheduler
        self.kernel_threads = kernel_threads
        self.tuning_database_dir = tuning_database_dir
        self.start_batcher = start_batcher
        self.memory_guard = memory_guard
        # One upload or delete at a time: versions and the store stay consistent.
        self._lock = threading.Lock()
        self.probes = PaddingProbes(settings, metrics, tuning_database_dir, settle=self._settle_probe)

    def restore_stored(self) -> tuple[int, int]:
        """Serve every stored model again (its current version) and queue its warm buckets. Returns
        (models served, models skipped: damaged on disk or no longer servable; each one logged)."""
        stored, damaged = self.models.load_all()
        served = 0
        for record, data in stored:
            try:
                self._serve_stored(record, data)
                served += 1
            except JitServeError as exc:
                log.error("cannot serve stored model %s: %s", record.name, exc)
        return served, damaged + len(stored) - served

    def _serve_stored(self, record: ModelRecord, data: bytes) -> ServedModel:
        """Serve a stored version (at start, on a repository load, following a peer) if it fits in memory:
        one that does not is skipped (logged) rather than the server killed for memory later."""
        model = load_model(data, max_bytes=len(data))
        self.memory_guard.check_upload(record.name, model.weight_bytes)
        if record.probe_version < PROBE_VERSION:
            record = self._forget_verdicts(record, model)
        served = self.build_served(record, model)
        del data, model
        served.model = served.model.stored_at(self.models.model_path(record))
        self.registry.put(served)
        self._after_put(served)
        return served

    def _forget_verdicts(self, record: ModelRecord, model: LoadedModel) -> ModelRecord:
        """A version stored before its padding probe ended, or with the verdicts of an older probe: served
        exactly until the probe (in the background) judges its axes again. Routes measured under older
        verdicts are forgotten: each bucket is timed and gated again once its kernel (kept in the store)
        is loaded."""
        policies = {axis: record.config.policy_for(axis) for axis in model.signature.axes()}
        record = record.model_copy(update={"safety": policy_verdicts(model.signature, policies)})
        if record.probe_version != UNPROBED:
            old = record.probe_version
            log.info("model %s v%d: its padding verdicts (probe %d) are made again", record.name, record.version, old)
            buckets = {label: known.model_copy(update={"route": None}) for label, known in record.buckets.items()}
            record = record.model_copy(update={"buckets": buckets})
            self.models.update_fields(record, "buckets")
        return record

    def _after_put(self, served: ServedModel) -> None:
        """A version just served: its warm buckets queued, or its padding probe started (which queues them)."""
        if served.padding_probe.settled:
            self.scheduler.enqueue_warm(served)
        else:
            self.probes.start(served)

    def load_stored(self, name: str) -> ServedModel:
        """Serve a stored model again (a no-op for one being served): the repository extension's load."""
        with self._lock:
            served = self.registry.find(name)
            if served is not None:
                return served
            found = self.models.load(name)
            if found is None:
                raise NotFoundError(f"no stored model {name!r}")
            return self._serve_stored(*found)

    def unload(self, name: str) -> None:
        """Stop serving a model but keep it stored: the repository extension's unload."""
        with self._lock:
            self.registry.remove(name)

    def register(
        self, name: str, load: Callable[[], LoadedModel], config: dict | None = None, *, replace: bool = False
    ) -> ServedModel:
        """Serve the model ``load`` reads and validates, through ONNX Runtime at once; its padding probe
        runs after this returns (:mod:`.padding_probes`). Loading and validation run outside the lock;
        versions are taken under it."""
        check_model_name(name)
        self._previous(name, replace)  # a taken name is refused before the expensive work
        model = load()
        self.memory_guard.check_upload(name, model.weight_bytes)  # before ONNX Runtime takes its copies
        check_served_sizes(model, self.settings)
        parsed = parse_config(model, config)
        check_sizes_fit(model.signature, parsed.probe_sizes, self.settings.max_tensor_bytes, "probe_sizes")
        policies = {axis: parsed.policy_for(axis) for axis in model.signature.axes()}
        safety = policy_verdicts(model.signature, policies)  # the rest are the probe's, after the answer
        try:
            warm = warm_buckets(model, parsed, assumed_padding_safe(model, parsed, policies, safety))
        except BadRequestError as exc:
            raise BadRequestError(f"config warm_buckets: {exc}") from None
        check_warm_sizes(model, policies, warm, self.settings.max_tensor_bytes)
        ort = open_onnxruntime(self.settings, model, model_target(self.settings, parsed, self.kernel_threads))
        with self._lock, self.models.locked():
            previous = self._previous(name, replace)
            stored = self.models.latest_version(name)
            record = ModelRecord(
                name=name,
                version=max(stored or 0, previous.record.version if previous else 0) + 1,
                digest=model.digest,
                config=parsed,
                safety=safety,
                probe_version=PROBE_VERSION if len(safety) == len(policies) else UNPROBED,
                created_at=time.time(),
                buckets=dict(previous.record.buckets) if previous else {},
            )
            served = self.build_served(record, model, ort)
            try:
                free = self.scheduler.free_slots
                if self.scheduler.enabled and len(warm) > free:
                    raise UnavailableError(f"compile queue is full ({free} free slots, {len(warm)} warm buckets)")
                self.models.save(record, model.data, model.tokenizer)
            except BaseException:
                served.retire()  # never served: stop its batcher
                raise
            # Stored: the served model lets go of the proto and bytes (a compile child reads the file).
            served.model = served.model.stored_at(self.models.model_path(record))
            self.registry.put(served)
            self._after_put(served)
            return served

    def follow_store(self, name: str) -> str | None:
        """Catch up with what another replica did to ``name`` in the shared store: serve its newest
        version, or stop serving it once deleted there. Returns the change made, if any."""
        with self._lock:
            served = self.registry.find(name)
            with self.models.locked():  # a version read whole, never one being replaced under us
                stored = self.models.latest_version(name)
                current = served is not None and stored is not None and served.record.version >= stored
                # This replica's own upload (or one it followed) is not read again: bytes the size of the model.
                found = self.models.load(name) if stored is not None and not current else None
            if stored is None and served is not None:
                self.registry.remove(name)
                return "deleted"
            if found is None:  # served here already, gone and not served here, or stored but unreadable (logged)
                return None
            record, data = found
            try:
                self._serve_stored(record, data)
            except JitServeError as exc:
                log.error("cannot serve model %s v%d from the store: %s", name, record.version, exc)
                return None
            return "new_version" if served is not None else "new_model"

    def close(self) -> None:
        """Shutdown: padding probes in progress end (their models are probed again at the next start)."""
        self.probes.close()

    def _previous(self, name: str, replace: bool) -> ServedModel | None:
        previous = self.registry.find(name)  # a name stored by another replica is taken too
        taken = previous is not None or self.models.latest_version(name) is not None
        if taken and not replace:
            raise ConflictError(f"model {name!r} exists; PUT with ?replace=true to upload a new version")
        return previous

    def delete(self, name: str) -> None:
        with self._lock, self.models.locked():
            if self.registry.find(name) is not None:
                self.registry.remove(name)
            elif self.models.latest_version(name) is None:
                raise NotFoundError(f"model {name!r} not found")
            self.models.delete(name)

    def build_served(self, record: ModelRecord, model: LoadedModel, ort: OrtEngine | None = None) -> ServedModel:
        """The served version of a record. With a verdict for every axis its warm buckets and batching are
        set up now; otherwise its padding probe is pending, and they wait for its verdicts."""
        config = record.config
        target = model_target(self.settings, config, self.kernel_threads)
        options = compile_options(self.settings, config, self.tuning_database_dir, quantized=bool(model.integer_ops))
        policies = {axis: config.policy_for(axis) for axis in model.signature.axes()}
        planner = BucketPlanner(model.signature, policies, record.safety, config.overflow, warm_sizes(model, config))
        served = ServedModel(
            record,
            model,
            planner,
            ort or open_onnxruntime(self.settings, model, target),
            target,
            options,
            # Bound to the digest, not the model: a closure over the model would keep its proto and bytes.
            key_of=partial(bucket_key, model.graph_digest, target=target, options=options),
            padding_probe=PaddingProbe(pending=not set(policies) <= set(record.safety)),
        )
        if served.padding_probe.settled:
            self._put_verdicts_in_force(served)
        elif config.dynamic_batching is not None:
            served.batching = "off until the padding probe has judged the batch axis"
        return served

    def _put_verdicts_in_force(self, served: ServedModel) -> None:
        """What the model's verdicts decide: which buckets the warm shapes fall in, and whether requests
        are joined along its batch axis."""
        config, signature = served.record.config, served.model.signature
        for bucket in warm_buckets(served.model, config, served.planner):
            served.bucket_for(bucket).warm = True
        if config.dynamic_batching is None:
            return
        axis, why = find_batch_axis(signature, served.record.safety)
        if axis is None:
            served.batching = why
            log.warning("model %s: dynamic batching is off: %s", served.name, why)
            return
        preferred = config.dynamic_batching.preferred(served.planner.effective_policy(axis))
        with served.lock:  # a version retired meanwhile gets no batcher (retire closes it under the lock)
            if not served.retired:
                served.batching = why
                served.batcher = self.start_batcher(served, config.dynamic_batching, preferred)
                served.batch_verdicts = BatchVerdicts(
                    served.planner, served.find_bucket, preferred, inline_max_ms=self.settings.inline_max_ms
                )

    # -- the padding probe, in the background ------------------------------

    def _settle_probe(self, served: ServedModel, verdicts: dict[str, AxisSafety], probed: bool) -> bool:
        """Put a probe's verdicts in force and queue the warm buckets they plan; store them when ``probed``
        (a failed probe's stay in memory: the next start probes again). False, changing nothing, when the
        version was deleted, replaced or unloaded meanwhile: a newer version's record is never touched."""
        with self._lock:
            if served.retired or self.registry.find(served.name) is not served:
                return False
            record = served.settle_safety(verdicts, PROBE_VERSION if probed else served.record.probe_version)
            self._put_verdicts_in_force(served)
            if probed:
                self.models.update_fields(record, "safety", "probe_version")
            for bucket in served.all_buckets():
                if bucket.reason == WAITING_FOR_VERDICTS:  # planned without them: it may see no request again
                    bucket.note("cold: planned before the padding probe's verdicts")
                if bucket.warm and not self.scheduler.enqueue(served, bucket):
                    log.warning("model %s: warm bucket %s not queued (compile queue full)", served.name, bucket.label)
            return True
