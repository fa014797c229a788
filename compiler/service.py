"""The data plane: model registry, JIT compile queue, kernel cache, inference.

The HTTP layer calls these methods and maps :class:`JitServeError` to status
codes. Requests are served at once: by the bucket's verified TVM kernel when
it is loaded, else by ONNX Runtime while one compile for the bucket runs in
the background (single-flight, bounded queue, child processes).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import ValidationError

from .arrays import random_inputs
from .bench import median_latencies_ms
from .buckets import AxisSafety, Bucket, BucketPlanner, bucket_label
from .build import CompileOptions, bucket_key, compile_bucket
from .engines import Engine, OrtEngine, TvmEngine
from .errors import (
    BadRequestError,
    ConflictError,
    InvalidModelError,
    JitServeError,
    NotFoundError,
    UnavailableError,
)
from .kernel_cache import KernelCache
from .metrics import Metrics
from .model import LoadedModel, load_model
from .padding import check_axis_padding
from .registry import BucketRecord, ModelConfig, ModelRecord, ModelStore, check_model_name
from .settings import Settings
from .store import ArtifactStore
from .target import resolve_target, target_kind
from .threads import apply_thread_plan
from .tuner import BackgroundTuner

log = logging.getLogger("jitserve")

State = Literal["new", "queued", "compiling", "ready", "failed"]
DEFAULT_PROBE_SIZE = 32


@dataclass
class BucketState:
    label: str
    bucket: Bucket
    key: str
    warm: bool = False
    state: State = "new"
    reason: str | None = None
    compile_seconds: float | None = None
    hits: int = 0
    route: str | None = None
    latency_ms: dict[str, float] = field(default_factory=dict)
    tuned_key: str | None = None
    tuning: dict = field(default_factory=dict)

    def key_for(self, engine: str) -> str | None:
        return {"tvm": self.key, "tvm-tuned": self.tuned_key}.get(engine)

    def describe(self) -> dict:
        return {
            "bucket": self.label,
            "shapes": {k: list(v) for k, v in self.bucket.items()},
            "state": self.state,
            "reason": self.reason,
            "engine": self.route if self.state == "ready" and self.route else "onnxruntime",
            "latency_ms": self.latency_ms,
            "compile_seconds": self.compile_seconds,
            "hits": self.hits,
            "warm": self.warm,
            "tuning": self.tuning or None,
        }


@dataclass
class ServedModel:
    """One version of one model; replaced whole, so in-flight requests finish on it."""

    record: ModelRecord
    model: LoadedModel
    planner: BucketPlanner
    ort: OrtEngine
    target: dict
    options: CompileOptions
    buckets: dict[str, BucketState] = field(default_factory=dict)
    retired: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def name(self) -> str:
        return self.record.name

    @property
    def dtypes(self) -> dict[str, str]:
        return {spec.name: spec.dtype for spec in self.model.signature.inputs}

    def state_for(self, bucket: Bucket) -> BucketState:
        label = bucket_label(bucket)
        with self.lock:
            state = self.buckets.get(label)
            if state is None:
                key = bucket_key(self.model, bucket, self.target, self.options)
                state = self.buckets[label] = BucketState(label, bucket, key)
            return state


def _probe_sizes(signature, config: ModelConfig) -> dict[str, int]:
    """Concrete sizes for every symbolic axis: config, else first warm bucket, else a default."""
    sizes = {axis: DEFAULT_PROBE_SIZE for axis in signature.axes()}
    if config.warm_buckets:
        for spec in signature.inputs:
            shape = config.warm_buckets[0].get(spec.name, [])
            for index, axis in spec.symbolic_axes():
                if index < len(shape):
                    sizes[axis] = shape[index]
    sizes.update({k: v for k, v in config.probe_sizes.items() if k in sizes})
    return sizes


class ModelService:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.kernel_threads = apply_thread_plan(settings.kernel_threads)
        self.models_store = ModelStore(settings.model_store_dir)
        self.artifacts = ArtifactStore(settings.kernel_store_dir)
        self.kernels = KernelCache(
            settings.kernel_cache_entries, settings.kernel_cache_bytes, on_evict=lambda _: metrics.record_eviction()
        )
        self._models: dict[str, ServedModel] = {}
        self._registry_lock = threading.Lock()
        self._compile_queue: queue.Queue[tuple[ServedModel, BucketState] | None] = queue.Queue(
            settings.compile_queue_size
        )
        self._compiles_running = 0
        self._running_lock = threading.Lock()
        self._workers: list[threading.Thread] = []
        self._pool = concurrent.futures.ThreadPoolExecutor(settings.inference_threads, "jitserve-infer")
        self._pool_slots = threading.BoundedSemaphore(settings.inference_threads + settings.inference_queue_size)
        self.tuner = BackgroundTuner(self)

    # -- lifecycle -------------------------------------------------------

    def start(self) -> None:
        for _ in range(self.settings.compile_workers):
            worker = threading.Thread(target=self._compile_worker, name="jitserve-compile", daemon=True)
            worker.start()
            self._workers.append(worker)
        for record, data in self.models_store.load_all():
            try:
                served = self._build_served(record, load_model(data, max_bytes=len(data)))
            except JitServeError as exc:
                log.error("cannot serve stored model %s: %s", record.name, exc)
                continue
            self._models[record.name] = served
            self._enqueue_warm(served)
        if self.jit_enabled and self.settings.tuning_enabled:
            self.tuner.start()

    def close(self) -> None:
        self.tuner.stop()
        # Drop queued compiles so the stop markers fit; running ones end with the process.
        while True:
            try:
                self._compile_queue.get_nowait()
            except queue.Empty:
                break
        for _ in self._workers:
            self._compile_queue.put(None)
        for worker in self._workers:
            worker.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)

    @property
    def tuning_database_dir(self) -> Path:
        """The MetaSchedule database shared by every bucket, applied at every compile."""
        return self.artifacts.root / "tuning"

    @property
    def model_names(self) -> list[str]:
        return sorted(self._models)

    def served_models(self) -> list[ServedModel]:
        return list(self._models.values())

    # -- registry --------------------------------------------------------

    def _options(self, config: ModelConfig) -> CompileOptions:
        s = self.settings
        return CompileOptions(
            rtol=config.rtol or s.verify_rtol,
            atol=config.atol or s.verify_atol,
            seed=s.verify_seed,
            timeout_seconds=s.compile_timeout_seconds,
            database_dir=str(self.tuning_database_dir),
        )

    def _target(self, config: ModelConfig) -> dict:
        try:
            return resolve_target(
                config.target or self.settings.target,
                cuda_arch=self.settings.cuda_arch,
                num_cores=self.kernel_threads,
            )
        except ValueError as exc:
            raise BadRequestError(f"config: {exc}") from None

    def _ort(self, model: LoadedModel, target: dict) -> OrtEngine:
        try:
            return OrtEngine(
                model.data,
                cuda=target["kind"] == "cuda",
                threads=self.settings.kernel_threads or None,
                spinning=self.settings.ort_spinning,
            )
        except Exception as exc:  # noqa: BLE001 - ORT raises its own exception types
            raise InvalidModelError(f"onnxruntime cannot load the model: {exc}") from None

    def _build_served(self, record: ModelRecord, model: LoadedModel, ort: OrtEngine | None = None) -> ServedModel:
        target = self._target(record.config)
        config = record.config
        policies = {axis: config.policy_for(axis) for axis in model.signature.axes()}
        planner = BucketPlanner(model.signature, policies, record.safety, config.overflow)
        ort = ort or self._ort(model, target)
        served = ServedModel(record, model, planner, ort, target, self._options(config))
        for shapes in config.warm_buckets:
            plan = planner.plan({k: tuple(v) for k, v in shapes.items()})
            served.state_for(plan.bucket).warm = True
        return served

    def _check_padding(self, model: LoadedModel, ort: OrtEngine, config: ModelConfig) -> dict[str, AxisSafety]:
        signature = model.signature
        sizes = _probe_sizes(signature, config)
        options = self._options(config)
        results = {}
        for axis in signature.axes():
            policy = config.policy_for(axis)
            if policy.kind == "exact":
                results[axis] = AxisSafety(axis=axis, safe=False, reason="policy is exact: never padded")
                continue
            size = sizes[axis]
            padded = policy.bucket_size(size)
            if padded is None or padded <= size:
                padded = policy.bucket_size(size + 1) or size + 1
            results[axis] = check_axis_padding(
                ort,
                signature,
                axis,
                sizes,
                padded,
                pad_values=config.pad_values,
                rtol=options.rtol,
                atol=options.atol,
                seed=options.seed,
            )
        return results

    def _parse_config(self, model: LoadedModel, config: dict | None) -> ModelConfig:
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
        return parsed

    def register(self, name: str, data: bytes, config: dict | None = None, *, replace: bool = False) -> dict:
        check_model_name(name)
        with self._registry_lock:
            previous = self._models.get(name)
            if previous is not None and not replace:
                raise ConflictError(f"model {name!r} exists; PUT with ?replace=true to upload a new version")
            model = load_model(data, max_bytes=self.settings.max_model_bytes)
            parsed = self._parse_config(model, config)
            target = self._target(parsed)
            ort = self._ort(model, target)
            safety = self._check_padding(model, ort, parsed)
            record = ModelRecord(
                name=name,
                version=previous.record.version + 1 if previous else 1,
                digest=model.digest,
                config=parsed,
                safety=safety,
                created_at=time.time(),
                buckets=dict(previous.record.buckets) if previous else {},
            )
            try:
                served = self._build_served(record, model, ort)
            except BadRequestError as exc:
                raise BadRequestError(f"config warm_buckets: {exc}") from None
            warm = [s for s in served.buckets.values() if s.warm]
            free = self._compile_queue.maxsize - self._compile_queue.qsize()
            if self.jit_enabled and len(warm) > free:
                raise UnavailableError(f"compile queue is full ({free} free slots, {len(warm)} warm buckets)")
            self.models_store.save(record, data)
            self._models[name] = served
            if previous is not None:
                previous.retired = True
            self._enqueue_warm(served)
            return self.describe(name)

    def delete(self, name: str) -> None:
        with self._registry_lock:
            served = self._models.pop(name, None)
            if served is None:
                raise NotFoundError(f"model {name!r} not found")
            served.retired = True
            self.models_store.delete(name)

    def get(self, name: str) -> ServedModel:
        served = self._models.get(name)
        if served is None:
            raise NotFoundError(f"model {name!r} not found")
        return served

    def describe(self, name: str) -> dict:
        served = self.get(name)
        record = served.record
        with served.lock:
            buckets = [state.describe() for state in served.buckets.values()]
        return {
            "name": record.name,
            "version": record.version,
            "digest": record.digest,
            "target": served.target,
            "signature": served.model.signature.to_json(),
            "axes": {
                axis: {
                    "policy": served.planner.policies[axis].model_dump(),
                    "effective_policy": served.planner.effective_policy(axis).kind,
                    "padding_safety": record.safety[axis].model_dump() if axis in record.safety else None,
                }
                for axis in served.model.signature.axes()
            },
            "overflow": record.config.overflow,
            "buckets": buckets,
        }

    @property
    def jit_enabled(self) -> bool:
        """With no compile workers jitserve serves everything through ONNX Runtime."""
        return self.settings.compile_workers > 0

    def ready(self) -> tuple[bool, list[str]]:
        if not self.jit_enabled:
            return True, []
        waiting = [
            f"{served.name}:{state.label}"
            for served in list(self._models.values())
            for state in list(served.buckets.values())
            if state.warm and state.state not in ("ready", "failed")
        ]
        return not waiting, waiting

    # -- compiling -------------------------------------------------------

    def _update_queue_depth(self) -> None:
        self.metrics.set_queue_depth(depth=self._compile_queue.qsize() + self._compiles_running)

    def _enqueue(self, served: ServedModel, state: BucketState) -> bool:
        """Single-flight: a bucket is queued at most once at a time."""
        if not self.jit_enabled:
            return True
        with served.lock:
            if state.state != "new":
                return True
            state.state = "queued"
        try:
            self._compile_queue.put_nowait((served, state))
        except queue.Full:
            with served.lock:
                state.state = "new"  # the next request for it tries again
            return False
        self._update_queue_depth()
        return True

    def _enqueue_warm(self, served: ServedModel) -> None:
        for state in list(served.buckets.values()):
            if state.warm:
                self._enqueue(served, state)

    def _compile_worker(self) -> None:
        while True:
            job = self._compile_queue.get()
            if job is None:
                return
            served, state = job
            with self._running_lock:
                self._compiles_running += 1
            self._update_queue_depth()
            try:
                if not served.retired:
                    self._compile(served, state)
            except Exception:  # a worker must survive any one job
                log.exception("compile of %s %s failed unexpectedly", served.name, state.label)
                state.state, state.reason = "failed", "internal error"
            finally:
                with self._running_lock:
                    self._compiles_running -= 1
                self._update_queue_depth()

    def _recompile_reason(self, served: ServedModel, state: BucketState) -> str | None:
        previous = served.record.buckets.get(state.label)
        if previous is None:
            return None
        if previous.key == state.key:
            return "artifact_missing"
        if previous.model_version != served.record.version:
            return "new_model_version"
        return "target_or_compiler_changed"

    def _compile(self, served: ServedModel, state: BucketState) -> None:
        """Make the bucket's kernel available: compile (or find it stored), load, measure, route."""
        name, kind = served.name, target_kind(served.target)
        state.state = "compiling"
        reason = self._recompile_reason(served, state) if self.artifacts.get(state.key) is None else None
        try:
            outcome = compile_bucket(served.model, state.bucket, served.target, self.artifacts, served.options)
        except JitServeError as exc:
            self.metrics.record_compile(model=name, target=kind, tier="tvm", outcome="error", seconds=None)
            state.state, state.reason = "failed", str(exc)
            log.warning("compile of %s %s failed: %s", name, state.label, exc)
            return
        manifest = outcome.manifest
        state.compile_seconds = manifest.compile_seconds
        if not outcome.cached:
            verdict = "ok" if manifest.verified else "verify_failed"
            self.metrics.record_compile(
                model=name, target=kind, tier="tvm", outcome=verdict, seconds=manifest.compile_seconds
            )
            if reason:
                self.metrics.record_recompile(model=name, reason=reason)
            log.info("compiled %s %s in %.1fs (%s)", name, state.label, manifest.compile_seconds, verdict)
        if manifest.verified is not True:
            state.state = "failed"
            state.reason = f"verification against onnxruntime: {manifest.verification}"
            return
        if outcome.cached:
            self.metrics.record_reload(model=name)
        kernel = self._load_kernel(served, state.key)
        if not (outcome.cached and self._restore_route(served, state)):
            self._route(served, state, {"tvm": kernel})

    def tune(self, served: ServedModel, state: BucketState) -> float:
        """Tune a ready bucket (background, budgeted), verify, re-measure, hot-swap the route.

        Returns the seconds spent. Requests keep being served throughout: the
        route changes in one assignment and in-flight requests finish on the
        engine they started with.
        """
        name, kind, s = served.name, target_kind(served.target), self.settings
        options = served.options.model_copy(
            update={
                "tune_trials": s.tune_trials_per_bucket,
                "tune_trials_per_task": s.tune_trials_per_task,
                "timeout_seconds": s.tuning_seconds_per_bucket,
            }
        )
        state.tuning = {"state": "tuning", "trials": 0, "seconds": 0.0}
        started = time.perf_counter()
        try:
            outcome = compile_bucket(served.model, state.bucket, served.target, self.artifacts, options)
        except JitServeError as exc:
            seconds = time.perf_counter() - started
            self.metrics.record_compile(model=name, target=kind, tier="tvm-tuned", outcome="error", seconds=None)
            self.metrics.record_tuning(model=name, trials=0, seconds=seconds)
            state.tuning = {"state": "failed", "reason": str(exc), "seconds": round(seconds, 1)}
            self._remember(served, state)
            return seconds
        manifest = outcome.manifest
        facts = manifest.tuning or {}
        seconds = time.perf_counter() - started
        if not outcome.cached:
            verdict = "ok" if manifest.verified else "verify_failed"
            self.metrics.record_compile(
                model=name, target=kind, tier="tvm-tuned", outcome=verdict, seconds=manifest.compile_seconds
            )
            self.metrics.record_tuning(model=name, trials=facts.get("trials", 0), seconds=seconds)
        state.tuning = {
            "state": "done" if manifest.verified else "failed",
            "trials": facts.get("trials"),
            "tasks": facts.get("tasks"),
            "seconds": round(facts.get("tune_seconds", seconds), 1),
        }
        if manifest.verified is not True:
            state.tuning["reason"] = f"verification against onnxruntime: {manifest.verification}"
            self._remember(served, state)
            return seconds
        state.tuned_key = manifest.key
        kernels = {
            "tvm": self.kernels.get(state.key) or self._load_kernel(served, state.key),
            "tvm-tuned": self._load_kernel(served, manifest.key),
        }
        self._route(served, state, kernels)
        return seconds

    def _route(self, served: ServedModel, state: BucketState, kernels: dict[str, Engine]) -> None:
        """Time every verified engine on the bucket and serve it with the fastest."""
        inputs = random_inputs(state.bucket, served.dtypes, self.settings.verify_seed + 1)
        latency = median_latencies_ms(
            {"onnxruntime": served.ort, **kernels}, inputs, warmup=2, runs=self.settings.routing_runs
        )
        if self.settings.routing == "compiled":
            route = "tvm-tuned" if "tvm-tuned" in kernels else "tvm"
        else:
            route = min(latency, key=latency.get)
        state.latency_ms = {k: round(v, 4) for k, v in latency.items()}
        state.route, state.state, state.reason = route, "ready", None
        self.metrics.record_routing(model=served.name, engine=route)
        log.info("routed %s %s to %s (%s)", served.name, state.label, route, state.latency_ms)
        self._remember(served, state)

    def _remember(self, served: ServedModel, state: BucketState) -> None:
        """Persist what a restart needs: keys, measured latencies, the route, tuning."""
        if served.retired:
            return
        served.record.buckets[state.label] = BucketRecord(
            key=state.key,
            model_version=served.record.version,
            latency_ms=state.latency_ms,
            route=state.route,
            tuned_key=state.tuned_key,
            tuning=state.tuning,
        )
        self.models_store.update_record(served.record)

    def _load_kernel(self, served: ServedModel, key: str) -> Engine:
        """Load a stored kernel into the cache: a reload, never a compile."""
        signature = served.model.signature
        engine = TvmEngine(
            self.artifacts.library_path(key),
            signature.input_names,
            signature.output_names,
            device=target_kind(served.target),
        )
        manifest = self.artifacts.get(key)
        self.kernels.put(key, engine, manifest.library_bytes if manifest else 0)
        self.metrics.set_cache_entries(entries=len(self.kernels))
        return engine

    def _restore_route(self, served: ServedModel, state: BucketState) -> bool:
        """A bucket routed by an earlier process keeps its measured route (no compile, no re-measure)."""
        known = served.record.buckets.get(state.label)
        if known is None or known.key != state.key or known.route is None:
            return False
        state.tuned_key, state.tuning = known.tuned_key, dict(known.tuning)
        routed_key = state.key_for(known.route)
        manifest = self.artifacts.get(routed_key) if routed_key else None
        if known.route != "onnxruntime" and (manifest is None or manifest.verified is not True):
            return False
        compiled = self.artifacts.get(state.key)
        state.route, state.latency_ms = known.route, dict(known.latency_ms)
        state.compile_seconds = compiled.compile_seconds if compiled else None
        state.state = "ready"
        return True

    def _kernel_for(self, served: ServedModel, state: BucketState) -> Engine | None:
        """The kernel that serves this bucket, or None for ONNX Runtime."""
        if state.state == "new" and not self._restore_route(served, state):
            self.metrics.record_cache_lookup(model=served.name, hit=False)
            self._enqueue(served, state)
            return None
        key = state.key_for(state.route) if state.state == "ready" else None
        if key is None:
            return None
        engine = self.kernels.get(key)
        self.metrics.record_cache_lookup(model=served.name, hit=engine is not None)
        if engine is None:  # evicted, or routed by an earlier process
            engine = self._load_kernel(served, key)
            self.metrics.record_reload(model=served.name)
        return engine

    # -- inference -------------------------------------------------------

    def submit_predict(self, name: str, inputs: Any) -> concurrent.futures.Future:
        """Run :meth:`predict` on the bounded inference pool; 503 when it is full."""
        if not self._pool_slots.acquire(blocking=False):
            raise UnavailableError("inference pool is full; retry later")
        try:
            future = self._pool.submit(self.predict, name, inputs)
        except RuntimeError:
            self._pool_slots.release()
            raise UnavailableError("server is shutting down") from None
        future.add_done_callback(lambda _: self._pool_slots.release())
        return future

    def predict(self, name: str, inputs: Any) -> dict:
        started = time.perf_counter()
        served = self._models.get(name)
        if served is None:
            self.metrics.record_request(model="", engine="none", code=404)
            raise NotFoundError(f"model {name!r} not found")
        engine_name = "none"
        try:
            arrays = parse_inputs(served.model.signature, inputs)
            plan = served.planner.plan({k: v.shape for k, v in arrays.items()})
            state = served.state_for(plan.bucket)
            state.hits += 1
            kernel = self._kernel_for(served, state)
            inference_started = time.perf_counter()
            if kernel is not None:
                engine_name = state.route
                padded = served.planner.pad(arrays, plan, served.record.config.pad_values)
                outputs = served.planner.unpad(kernel.run(padded), plan)
                self.metrics.record_padding(model=name, waste=plan.padding_waste())
            else:
                engine_name = "onnxruntime"
                outputs = served.ort.run(arrays)
            inference_ms = (time.perf_counter() - inference_started) * 1000
        except JitServeError as exc:
            self.metrics.record_request(model=name, engine=engine_name, code=exc.http_status)
            raise
        self.metrics.record_request(model=name, engine=engine_name, code=200, seconds=time.perf_counter() - started)
        return {
            "model": name,
            "version": served.record.version,
            "outputs": {k: np.ascontiguousarray(v) for k, v in outputs.items()},
            "engine": engine_name,
            "bucket": state.label,
            # Not part of the body: the HTTP layer sends it as a Server-Timing header.
            "inference_ms": inference_ms,
        }


def parse_inputs(signature, inputs: Any) -> dict[str, np.ndarray]:
    """JSON values -> arrays of the model's dtypes; 400 naming what is wrong."""
    if not isinstance(inputs, dict):
        raise BadRequestError("'inputs' must be an object mapping input names to nested lists")
    expected = signature.input_names
    for name in inputs:
        if name not in expected:
            raise BadRequestError(f"unknown input {name!r}; the model takes {expected}")
    arrays = {}
    for spec in signature.inputs:
        if spec.name not in inputs:
            raise BadRequestError(f"missing input {spec.name!r}")
        try:
            array = np.asarray(inputs[spec.name])
        except ValueError:
            raise BadRequestError(
                f"input {spec.name!r} is ragged: nested lists must form a rectangular array"
            ) from None
        if array.dtype == object:
            raise BadRequestError(f"input {spec.name!r} must be a rectangular nested list of numbers")
        if array.dtype.kind not in "biuf":
            raise BadRequestError(f"input {spec.name!r} must be numeric, got {array.dtype.kind!r} data")
        if array.ndim != spec.rank:
            raise BadRequestError(f"input {spec.name!r} has rank {array.ndim}, expected {spec.rank} {list(spec.dims)}")
        want = np.dtype(spec.dtype)
        if want.kind in "iub" and array.dtype.kind == "f" and not np.all(np.mod(array, 1) == 0):
            raise BadRequestError(f"input {spec.name!r} has dtype {spec.dtype}: got non-integer values")
        if want.kind in "iu" and array.size:
            low, high = np.iinfo(want).min, np.iinfo(want).max
            if array.min() < low or array.max() >= high + 1:  # + 1: high rounds up as a float
                raise BadRequestError(f"input {spec.name!r} has dtype {spec.dtype}: values outside [{low}, {high}]")
        if want.kind == "f" and array.size and np.isfinite(array).all() and not np.isfinite(array.astype(want)).all():
            raise BadRequestError(f"input {spec.name!r} has dtype {spec.dtype}: values overflow it")
        if want.kind == "b" and array.size and not np.all((array == 0) | (array == 1)):
            raise BadRequestError(f"input {spec.name!r} has dtype bool: values must be 0/1 or true/false")
        arrays[spec.name] = np.ascontiguousarray(array.astype(want))
    return arrays
