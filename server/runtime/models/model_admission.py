"""Upload -> served model: validate the bytes and the config, check which
axes padding may change, build the served model, store it, queue its warm
buckets. Also brings back the stored models at start."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from pydantic import ValidationError

from compiler.building.build import bucket_key
from compiler.building.options import CompileOptions
from compiler.building.target import resolve_target
from compiler.errors import (
    BadRequestError,
    ConflictError,
    InvalidModelError,
    JitServeError,
    NotFoundError,
    UnavailableError,
)
from compiler.models.memory import check_model_fits, check_sizes_fit
from compiler.models.model import LoadedModel, load_model
from compiler.running.engines import OrtEngine
from compiler.shapes.buckets import AxisSafety, BucketPlanner
from compiler.shapes.padding import PROBE_VERSION, default_probe_sizes, probe_padding

from ...settings import Settings
from ..compiling.scheduler import CompileScheduler
from ..memory.memory_guard import MemoryGuard
from ..serving.batcher import DynamicBatcher, DynamicBatching, find_batch_axis
from .records import ModelConfig, ModelRecord, ModelStore, check_model_name
from .registry import Registry, ServedModel

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
        self.closing = threading.Event()

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
        ort = None
        if record.probe_version < PROBE_VERSION:
            ort = self._ort(model, self._target(record.config))
            record = self._probe_again(record, model, ort)
        served = self.build_served(record, model, ort)
        del data, model
        served.model = served.model.stored_at(self.models.model_path(record))
        self.registry.put(served)
        self.scheduler.enqueue_warm(served)
        return served

    def _probe_again(self, record: ModelRecord, model: LoadedModel, ort: OrtEngine) -> ModelRecord:
        """A model stored with verdicts of an older padding probe gets new ones, and its buckets' routes
        are forgotten: each is timed and gated again once its kernel (kept in the store) is loaded."""
        safety = self._check_padding(model, ort, record.config)
        buckets = {label: known.model_copy(update={"route": None}) for label, known in record.buckets.items()}
        record = record.model_copy(update={"safety": safety, "probe_version": PROBE_VERSION, "buckets": buckets})
        self.models.update_fields(record, "safety", "probe_version", "buckets")
        log.info("model %s v%d: padding verdicts made again (probe %d)", record.name, record.version, PROBE_VERSION)
        return record

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
        """Serve the model ``load`` reads and validates. Loading, validation and the padding probe run
        outside the lock (a slow probe holds up no other upload); versions are taken under it."""
        check_model_name(name)
        self._previous(name, replace)  # a taken name is refused before the expensive work
        model = load()
        self.memory_guard.check_upload(name, model.weight_bytes)  # before ONNX Runtime takes its copies
        check_served_sizes(model, self.settings)
        parsed = parse_config(model, config)
        ort = self._ort(model, self._target(parsed))
        safety = self._check_padding(model, ort, parsed)
        with self._lock, self.models.locked():
            previous = self._previous(name, replace)
            stored = self.models.latest_version(name)
            record = ModelRecord(
                name=name,
                version=max(stored or 0, previous.record.version if previous else 0) + 1,
                digest=model.digest,
                config=parsed,
                safety=safety,
                probe_version=PROBE_VERSION,
                created_at=time.time(),
                buckets=dict(previous.record.buckets) if previous else {},
            )
            try:
                served = self.build_served(record, model, ort)
            except BadRequestError as exc:
                raise BadRequestError(f"config warm_buckets: {exc}") from None
            try:
                check_warm_sizes(served, self.settings.max_tensor_bytes)
                warm = [bucket for bucket in served.all_buckets() if bucket.warm]
                free = self.scheduler.free_slots
                if self.scheduler.enabled and len(warm) > free:
                    raise UnavailableError(f"compile queue is full ({free} free slots, {len(warm)} warm buckets)")
                self.models.save(record, model.data)
            except BaseException:
                served.retire()  # never served: stop its batcher
                raise
            # Stored: the served model lets go of the proto and bytes (a compile child reads the file).
            served.model = served.model.stored_at(self.models.model_path(record))
            self.registry.put(served)
            self.scheduler.enqueue_warm(served)
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
        """Shutdown: a probe in progress ends (its upload answers 503)."""
        self.closing.set()

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
        config = record.config
        target = self._target(config)
        options = compile_options(self.settings, config, self.tuning_database_dir)
        policies = {axis: config.policy_for(axis) for axis in model.signature.axes()}
        planner = BucketPlanner(model.signature, policies, record.safety, config.overflow, _warm_sizes(model, config))
        served = ServedModel(
            record,
            model,
            planner,
            ort or self._ort(model, target),
            target,
            options,
            # Bound to the digest, not the model: a closure over the model would keep its proto and bytes.
            key_of=partial(bucket_key, model.graph_digest, target=target, options=options),
        )
        for shapes in config.warm_buckets:
            plan = planner.plan(model.signature.with_static_inputs({k: tuple(v) for k, v in shapes.items()}))
            served.bucket_for(plan.bucket).warm = True
        if config.dynamic_batching is not None:
            axis, served.batching = find_batch_axis(model.signature, record.safety)
            if axis is None:
                log.warning("model %s: dynamic batching is off: %s", record.name, served.batching)
            else:
                preferred = config.dynamic_batching.preferred(planner.effective_policy(axis))
                served.batcher = self.start_batcher(served, config.dynamic_batching, preferred)
        return served

    # -- parts of an upload ----------------------------------------------

    def _target(self, config: ModelConfig) -> dict:
        try:
            return resolve_target(
                config.target or self.settings.target, cuda_arch=self.settings.cuda_arch, num_cores=self.kernel_threads
            )
        except ValueError as exc:
            raise BadRequestError(f"config: {exc}") from None

    def _ort(self, model: LoadedModel, target: dict) -> OrtEngine:
        try:
            return OrtEngine(
                model.data,
                cuda=target["kind"] == "cuda",
                threads=self.settings.ort_threads or self.settings.kernel_threads or None,
                spinning=self.settings.ort_spinning,
            )
        except Exception as exc:  # noqa: BLE001 - ORT raises its own exception types
            raise InvalidModelError(f"onnxruntime cannot load the model: {exc}") from None

    def _check_padding(self, model: LoadedModel, ort: OrtEngine, config: ModelConfig) -> dict[str, AxisSafety]:
        options = compile_options(self.settings, config, self.tuning_database_dir)
        check_sizes_fit(model.signature, config.probe_sizes, self.settings.max_tensor_bytes, "probe_sizes")
        return probe_padding(
            ort,
            model.signature,
            {axis: config.policy_for(axis) for axis in model.signature.axes()},
            _probe_sizes(model.signature, config),
            configured=set(config.probe_sizes),
            pad_values=config.pad_values,
            rtol=options.rtol,
            atol=options.atol,
            seed=options.seed,
            index_limits=model.index_bounds.limits,
            max_input_bytes=self.settings.max_tensor_bytes,
            seconds=self.settings.probe_seconds,
            cancelled=self.closing,
        )


def compile_options(settings: Settings, config: ModelConfig, database_dir: Path) -> CompileOptions:
    """How the model's kernels are compiled and verified: the config's tolerances over the settings'."""
    return CompileOptions(
        rtol=config.rtol or settings.verify_rtol,
        atol=config.atol or settings.verify_atol,
        seed=settings.verify_seed,
        timeout_seconds=settings.compile_timeout_seconds,
        memory_limit_bytes=settings.compile_memory_bytes,
        database_dir=str(database_dir),
        nice=settings.compile_nice,
        idle_priority=settings.compile_idle_priority,
        explain=settings.explain_bundles,
    )


def check_served_sizes(model: LoadedModel, settings: Settings) -> None:
    """A model whose tensors or count of symbolic axes are past the settings' limits is refused at once."""
    check_model_fits(model.proto, model.signature, settings.max_tensor_bytes)
    axes, limit = len(model.signature.axes()), settings.max_symbolic_axes
    if axes > limit:
        raise BadRequestError(f"the model has {axes} symbolic axes; at most {limit} are served (max_symbolic_axes)")


def parse_config(model: LoadedModel, config: dict | None) -> ModelConfig:
    """The upload's config, checked against the model's axes and inputs."""
    try:
        parsed = ModelConfig.model_validate(config or {})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise BadRequestError(f"invalid config at {where or 'top level'}: {first['msg']}") from None
    axes = model.signature.axes()
    for axis in parsed.axes:
        if axis not in axes:
            raise BadRequestError(f"config names axis {axis!r}; the model's symbolic axes are {sorted(axes)}")
    for axis in parsed.probe_sizes:
        if axis not in axes:
            raise BadRequestError(f"config probe_sizes names axis {axis!r}; the model's axes are {sorted(axes)}")
    for name in parsed.pad_values:
        if name not in model.signature.input_names:
            raise BadRequestError(f"config pad_values names unknown input {name!r}")
    batching, axis = parsed.dynamic_batching, model.signature.leading_axis()
    if batching is not None and axis is not None:
        largest = parsed.policy_for(axis).largest
        if largest is not None and batching.max_batch_size > largest:
            raise BadRequestError(
                f"config dynamic_batching.max_batch_size {batching.max_batch_size} is beyond "
                f"the largest bucket of axis {axis!r} ({largest})"
            )
    return parsed


def check_warm_sizes(served: ServedModel, limit: int) -> None:
    """Warm buckets are compiled and verified at their bucket shapes; dynamic axes at their range's end."""
    signature = served.model.signature
    for bucket in served.all_buckets():
        sizes = {
            axis: dim
            for spec in signature.inputs
            for index, axis in spec.symbolic_axes()
            if isinstance(dim := bucket.bucket[spec.name][index], int)
        }
        check_sizes_fit(signature, sizes, limit, f"warm bucket {bucket.label}")
    for axis, policy in served.planner.policies.items():
        if policy.kind == "dynamic":
            check_sizes_fit(signature, {axis: policy.max}, limit, f"axes.{axis} dynamic max")


def _warm_sizes(model: LoadedModel, config: ModelConfig) -> dict[str, set[int]]:
    """Axis -> the sizes the warm buckets give it."""
    sizes: dict[str, set[int]] = {}
    for shapes in config.warm_buckets:
        for spec in model.signature.inputs:
            shape = shapes.get(spec.name, [])
            for index, axis in spec.symbolic_axes():
                if index < len(shape):
                    sizes.setdefault(axis, set()).add(int(shape[index]))
    return sizes


def _probe_sizes(signature, config: ModelConfig) -> dict[str, int]:
    """Starting sizes for every symbolic axis: the config's, else the first warm bucket's, else defaults."""
    known: dict[str, int] = {}
    if config.warm_buckets:
        for spec in signature.inputs:
            shape = config.warm_buckets[0].get(spec.name, [])
            for index, axis in spec.symbolic_axes():
                if index < len(shape) and shape[index] >= 1:
                    known[axis] = shape[index]
    known.update(config.probe_sizes)
    return default_probe_sizes(signature, known)
