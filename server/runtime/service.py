"""The runtime's front object: builds every part from the settings and gives
the HTTP layer the few calls it needs. Never imports FastAPI.

Requests are served at once: by the bucket's verified TVM kernel when it is
loaded, else by ONNX Runtime; a bucket whose traffic earns a compile
(compile admission) gets one in the background (single-flight, bounded
queue ordered by traffic, child processes below serving's priority).
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from compiler.building.build import compile_bucket
from compiler.building.threads import apply_thread_plan
from compiler.building.worker import stop_children
from compiler.errors import ConflictError, JitServeError
from compiler.models.model import load_model
from compiler.models.upload import load_upload_folder, upload_folder
from compiler.storage.store import KernelStore

from ..settings import Settings
from .compiling.builds import BucketBuilder, CompileFunction
from .compiling.compile_admission import CompileAdmission, compile_held
from .compiling.openvino_builds import OpenVinoBuilds
from .compiling.router import Router
from .compiling.scheduler import CompileScheduler
from .compiling.tuner import BackgroundTuner
from .memory.allocator import fix_mmap_threshold, return_memory, return_memory_now_and_after
from .memory.kernel_cache import EngineOpener, KernelCache, Kernels, open_tvm_engine
from .memory.memory_guard import MemoryGuard
from .models.model_admission import ModelAdmission
from .models.records import ModelStore
from .models.registry import Registry, ServedModel
from .models.store_janitor import StoreJanitor
from .models.store_watch import StoreWatch
from .observability.explain import Explanations
from .observability.metrics import Metrics
from .serving.batcher import DynamicBatcher, DynamicBatching
from .serving.bodies import BodyBudget, JsonParsers
from .serving.inference import Inference, Prediction
from .serving.requests import Codec, RequestPath
from .serving.shadow import ShadowChecks

T = TypeVar("T")

RELEASE_AGAIN_SECONDS = (2.0, 10.0)
"""A retired version's memory is handed back again these long after: once requests in flight, then work
still holding the version (a routing timing, a compile's end), are done."""
log = logging.getLogger("jitserve")


class ModelService:
    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        *,
        compile_function: CompileFunction = compile_bucket,
        open_engine: EngineOpener = open_tvm_engine,
    ) -> None:
        """``compile_function`` and ``open_engine`` default to the real compiler and TVM; tests pass fakes."""
        self.settings = settings
        self.metrics = metrics
        fix_mmap_threshold(settings.malloc_mmap_threshold_bytes)
        kernel_threads = apply_thread_plan(settings.kernel_threads, spinning=settings.ort_spinning)
        self.models_store = ModelStore(settings.model_store_dir)
        self.artifacts = KernelStore(settings.kernel_store_dir)
        cache = KernelCache(
            settings.kernel_cache_entries,
            settings.kernel_cache_bytes,
            on_evict=lambda _: metrics.kernels.record_eviction(),
        )
        openvino = OpenVinoBuilds(settings, metrics, self.artifacts.staging_area, threads=kernel_threads or None)
        self.kernels = Kernels(cache, self.artifacts, metrics, open_engine, openvino if openvino.enabled else None)
        self.registry = Registry(on_retire=self._release)
        self.explanations = Explanations(self.artifacts, settings.explain_profile_seconds, kernel_threads or None)
        self.router = Router(settings, metrics, self.models_store, self.artifacts)
        self.shadow = ShadowChecks(settings, metrics, self.router)
        self.builder = BucketBuilder(
            settings,
            metrics,
            self.kernels,
            self.router,
            compile_function=compile_function,
            tuning_profile=self.explanations.tuning_profile,
        )
        self.scheduler = CompileScheduler(
            settings.compile_workers, settings.compile_queue_size, metrics, self.builder.compile,
            hold=partial(compile_held, settings),
        )  # fmt: skip
        self.compile_admission = CompileAdmission(settings, metrics, self.scheduler, self.router, self.artifacts)
        metrics.before_scrape(lambda: self.compile_admission.refresh_storm_gauges(self.registry.all()))
        self.inference = Inference(
            self.registry,
            self.kernels,
            metrics,
            threads=settings.inference_threads,
            queue_size=settings.inference_queue_size,
            inline_max_ms=settings.inline_max_ms,
            admission=self.compile_admission,
            cold_lane=settings.cold_lane,
            kernel_input_max_abs=settings.kernel_input_max_abs,
            shadow=self.shadow,
        )
        self.admission = ModelAdmission(
            settings,
            self.registry,
            self.models_store,
            self.scheduler,
            kernel_threads=kernel_threads,
            tuning_database_dir=self.tuning_database_dir,
            start_batcher=partial(start_batcher, settings=settings, inference=self.inference, metrics=metrics),
            memory_guard=MemoryGuard(settings.memory_bytes, metrics, lambda: self.kernels.weights.total_bytes),
        )
        self.tuner = BackgroundTuner(settings, self.registry.all, self.builder.tune)
        self.store_watch = StoreWatch(
            self.models_store, self.admission.follow_store, metrics, interval=settings.model_watch_seconds
        )
        self.store_janitor = StoreJanitor(
            settings,
            self.artifacts,
            self.models_store,
            served=self.registry.all,
            in_use=self.kernels.loaded_keys,
            metrics=metrics,
        )
        self.json_parsers = JsonParsers(settings.json_parse_processes)
        body_budget = BodyBudget(settings.max_body_bytes_in_flight, settings.body_wait_seconds)
        self.requests = RequestPath(self.registry, self.inference, body_budget, self.json_parsers)
        self._startup_models: set[tuple[str, int]] = set()
        """(name, version) of the models served at start, whose warm buckets gate readiness."""

    # -- lifecycle -------------------------------------------------------

    def start(self) -> None:
        self.scheduler.start()
        kernels_ok, removed = self.artifacts.check()
        for problem in removed:
            log.warning("store check: removed damaged kernel %s", problem)
        self.store_watch.remember()
        models_ok, models_skipped = self.admission.restore_stored()
        self._startup_models = {(served.name, served.record.version) for served in self.registry.all()}
        log.info(
            "store check: %d kernels ok, %d damaged removed; %d models served, %d skipped",
            kernels_ok, len(removed), models_ok, models_skipped,
        )  # fmt: skip
        self.metrics.kernels.set_store_check(store="kernels", ok=kernels_ok, damaged=len(removed))
        self.metrics.kernels.set_store_check(store="models", ok=models_ok, damaged=models_skipped)
        if self.jit_enabled and self.settings.tuning_enabled:
            self.tuner.start()
        self.store_watch.start()
        if self.settings.kernel_store_bytes:
            self.store_janitor.start()

    def _release(self, served: ServedModel) -> None:
        """A version deleted, replaced or unloaded: its kernels and weights go, and the memory goes back to
        the system now and once the requests still running on it have ended."""
        self.kernels.forget(served)
        return_memory_now_and_after(RELEASE_AGAIN_SECONDS)

    def close(self) -> None:
        """Shutdown: models retired first (a compile killed now records nothing), then compile and
        tuning children killed, so their threads return at once."""
        self.admission.close()
        self.store_watch.stop()
        self.store_janitor.stop()
        self.tuner.stop()
        for served in self.registry.all():
            served.retire()
        stopped = stop_children()
        if stopped:
            log.info("shutdown: stopped %d compile or tuning children", stopped)
        self.scheduler.close()
        self.inference.close()
        self.shadow.close()
        self.json_parsers.close()

    @property
    def jit_enabled(self) -> bool:
        return self.scheduler.enabled

    @property
    def tuning_database_dir(self) -> Path:
        """The MetaSchedule database shared by every bucket, applied at every compile."""
        return self.artifacts.root / "tuning"

    # -- models ----------------------------------------------------------

    @property
    def model_names(self) -> list[str]:
        return self.registry.names

    def get(self, name: str) -> ServedModel:
        return self.registry.get(name)

    def describe(self, name: str) -> dict:
        return self._describe(self.registry.get(name))

    def _describe(self, served: ServedModel) -> dict:
        return served.describe() | {"compile_admission": self.compile_admission.describe(served)}

    def register(self, name: str, data: bytes, config: dict | None = None, *, replace: bool = False) -> dict:
        """Serve a self-contained model given as bytes."""
        load = partial(load_model, data, max_bytes=self.settings.max_model_bytes)
        return self._registered(self.admission.register(name, load, config, replace=replace))

    def _registered(self, served: ServedModel) -> dict:
        """An upload's answer; the copies its checks made (parsed protos, bytes) go back to the system."""
        return_memory()
        return self._describe(served)

    def register_default(self, name: str, data: bytes, config: dict) -> None:
        """Serve a built-in model on an empty store. Replicas starting together on one store race for
        it: the ones that lose serve the winner's."""
        try:
            self.register(name, data, config)
        except ConflictError:
            self.admission.follow_store(name)
        served = self.registry.find(name)
        if served is not None:  # part of the start: its warm buckets gate readiness
            self._startup_models.add((served.name, served.record.version))

    def new_upload_folder(self) -> Path:
        """A private folder to receive one upload into; cleared at start if a crash leaves it behind."""
        return upload_folder(self.models_store.staging_area)

    def register_upload(self, name: str, folder: Path, config: dict | None = None, *, replace: bool = False) -> dict:
        """Serve the model an upload folder holds (with its external data, or as an archive)."""
        load = partial(load_upload_folder, folder, max_bytes=self.settings.max_model_bytes)
        return self._registered(self.admission.register(name, load, config, replace=replace))

    def delete(self, name: str) -> None:
        self.admission.delete(name)

    def repository_index(self) -> list[dict]:
        """Every stored model with whether it is served (the repository extension's index)."""
        return [
            {"name": name, "version": str(served.record.version), "state": "READY", "reason": ""}
            if (served := self.registry.find(name)) is not None
            else {"name": name, "state": "UNAVAILABLE", "reason": "unloaded"}
            for name in self.models_store.names()
        ]

    def load_stored(self, name: str) -> None:
        self.admission.load_stored(name)

    def unload(self, name: str) -> None:
        self.admission.unload(name)

    def ready(self) -> tuple[bool, list[str]]:
        """Ready once the warm buckets of the models served at start are ready or failed; the ones still
        waiting otherwise. Models uploaded later (here or on a peer) never take a running server out of
        service: ONNX Runtime answers them while their kernels compile."""
        if not self.jit_enabled:
            return True, []
        waiting = [
            label
            for served in self.registry.all()
            if (served.name, served.record.version) in self._startup_models
            for label in served.waiting_warm_buckets()
        ]
        return not waiting, waiting

    # -- predictions -----------------------------------------------------

    async def infer(self, codec: Codec) -> tuple[Any, Prediction]:
        """A protocol's request, whole: the one way a request enters the runtime (:mod:`.requests`)."""
        return await self.requests.infer(codec)

    def predict(self, name: str, inputs: Any) -> Prediction:
        """Prepare and run a request in the calling thread."""
        try:
            job = self.inference.prepare(self.registry.get(name), inputs)
        except JitServeError as exc:
            self.inference.reject(name, exc)
            raise
        return self.inference.execute(job)


def start_batcher(
    served: ServedModel,
    config: DynamicBatching,
    preferred: set[int],
    *,
    settings: Settings,
    inference: Inference,
    metrics: Metrics,
) -> DynamicBatcher:
    """A model's dynamic batcher, running its batches on the inference pool."""
    return DynamicBatcher(
        served.name,
        config,
        preferred,
        inference.execute_batch,
        metrics,
        instances=settings.inference_threads,
        executor=inference.pool,
    )
