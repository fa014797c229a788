"""``build_runtime``: every part of the runtime built from the settings, in dependency order, and
handed to :class:`.service.ModelService` whole. Nothing is patched in after construction."""

from __future__ import annotations

from functools import partial

from compiler.building.build import compile_bucket
from compiler.building.threads import apply_thread_plan
from compiler.storage.store import KernelStore

from ..settings import Settings
from .compiling.builds import BucketBuilder, CompileFunction
from .compiling.compile_admission import CompileAdmission, compile_held
from .compiling.openvino_builds import OpenVinoBuilds
from .compiling.rerouter import Rerouter
from .compiling.router import Router
from .compiling.scheduler import CompileScheduler
from .compiling.tuner import BackgroundTuner
from .generation.generation import Generation
from .memory.allocator import fix_mmap_threshold, return_memory_now_and_after
from .memory.kernel_cache import EngineOpener, KernelCache, Kernels, open_tvm_engine
from .memory.memory_guard import MemoryGuard
from .models.model_admission import ModelAdmission
from .models.records import ModelStore
from .models.registry import Registry, ServedModel
from .models.store_janitor import StoreJanitor
from .models.store_watch import StoreWatch
from .observability.explain import Explanations
from .observability.metrics import Metrics
from .service import ModelService
from .serving.batcher import DynamicBatcher, DynamicBatching
from .serving.bodies import BodyBudget, JsonParsers
from .serving.inference import Inference
from .serving.requests import RequestPath
from .serving.shadow import ShadowChecks

RELEASE_AGAIN_SECONDS = (2.0, 10.0)
"""A retired version's memory is handed back again these long after: once requests in flight, then work
still holding the version (a routing timing, a compile's end), are done."""


def build_runtime(
    settings: Settings,
    metrics: Metrics | None = None,
    *,
    compile_function: CompileFunction = compile_bucket,
    open_engine: EngineOpener = open_tvm_engine,
) -> ModelService:
    """The runtime over ``settings``; ``compile_function`` and ``open_engine`` default to the real compiler
    and TVM (tests pass fakes). Sets the process's allocator threshold and thread plan."""
    metrics = metrics or Metrics()
    fix_mmap_threshold(settings.malloc_mmap_threshold_bytes)
    kernel_threads = apply_thread_plan(settings.kernel_threads, spinning=settings.ort_spinning)

    models_store = ModelStore(settings.model_store_dir)
    artifacts = KernelStore(settings.kernel_store_dir)
    memory_guard = MemoryGuard(settings.memory_bytes, metrics, lambda: kernels.weights.total_bytes)
    kernels = _kernels(settings, metrics, artifacts, open_engine, kernel_threads, memory_guard=memory_guard)
    generation = Generation(
        settings, metrics, lambda served: models_store.tokenizer(served.record), memory_guard.check_room
    )
    registry = Registry(on_retire=partial(release_retired, kernels, generation))
    explanations = Explanations(artifacts, settings.explain_profile_seconds, kernel_threads or None)
    router = Router(settings, metrics, models_store, artifacts)
    shadow = ShadowChecks(settings, metrics, router)
    builder = BucketBuilder(
        settings, metrics, kernels, router,
        compile_function=compile_function, tuning_profile=explanations.tuning_profile,
    )  # fmt: skip
    scheduler = CompileScheduler(
        settings.compile_workers, settings.compile_queue_size, metrics, builder.compile,
        hold=partial(compile_held, settings),
    )  # fmt: skip
    compile_admission = CompileAdmission(settings, metrics, scheduler, router, artifacts)
    metrics.before_scrape(lambda: compile_admission.refresh_storm_gauges(registry.all()))
    inference = Inference(
        registry,
        kernels,
        metrics,
        threads=settings.inference_threads,
        queue_size=settings.inference_queue_size,
        threads_per_model=settings.inference_threads_per_model,
        inline_max_ms=settings.inline_max_ms,
        admission=compile_admission,
        cold_lane=settings.cold_lane,
        kernel_input_max_abs=settings.kernel_input_max_abs,
        shadow=shadow,
    )
    admission = ModelAdmission(
        settings,
        registry,
        models_store,
        scheduler,
        kernel_threads=kernel_threads,
        tuning_database_dir=artifacts.tuning_database,
        start_batcher=partial(start_batcher, settings=settings, inference=inference, metrics=metrics),
        memory_guard=memory_guard,
        metrics=metrics,
    )
    json_parsers = JsonParsers(settings.json_parse_processes)
    body_budget = BodyBudget(settings.max_body_bytes_in_flight, settings.body_wait_seconds)
    return ModelService(
        settings=settings,
        metrics=metrics,
        models_store=models_store,
        artifacts=artifacts,
        kernels=kernels,
        registry=registry,
        explanations=explanations,
        router=router,
        shadow=shadow,
        builder=builder,
        scheduler=scheduler,
        compile_admission=compile_admission,
        inference=inference,
        admission=admission,
        tuner=BackgroundTuner(settings, registry.all, builder.tune),
        rerouter=Rerouter(settings, registry.all, kernels, router),
        store_watch=StoreWatch(models_store, admission.follow_store, metrics, interval=settings.model_watch_seconds),
        store_janitor=StoreJanitor(
            settings, artifacts, models_store, served=registry.all, in_use=kernels.loaded_keys, metrics=metrics
        ),
        json_parsers=json_parsers,
        generation=generation,
        requests=RequestPath(registry, inference, body_budget, json_parsers),
    )


def _kernels(
    settings: Settings,
    metrics: Metrics,
    artifacts: KernelStore,
    open_engine: EngineOpener,
    kernel_threads: int,
    *,
    memory_guard: MemoryGuard,
) -> Kernels:
    """The kernel cache over the store, with OpenVINO as an engine where it is enabled and installed (and
    the server has room for the model it compiles)."""
    cache = KernelCache(
        settings.kernel_cache_entries,
        settings.kernel_cache_bytes,
        on_evict=lambda _: metrics.kernels.record_eviction(),
    )
    openvino = OpenVinoBuilds(
        settings, metrics, artifacts.staging_area, threads=kernel_threads or None, check_room=memory_guard.check_room
    )
    return Kernels(
        cache,
        artifacts,
        metrics,
        open_engine,
        openvino if openvino.enabled else None,
        max_transformed_ratio=settings.max_transformed_weights_ratio,
    )


def release_retired(kernels: Kernels, generation: Generation, served: ServedModel) -> None:
    """A version deleted, replaced or unloaded: its kernels, weights and generation loop go, and the memory
    goes back to the system now and once the requests still running on it have ended."""
    generation.retire(served)
    kernels.forget(served)
    return_memory_now_and_after(RELEASE_AGAIN_SECONDS)


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
        executor=inference.pool.lane(served.name),
    )
