"""Every jitserve metric, defined in one place.

One :class:`Metrics` object owns its own registry (no globals, so each app
and each test has its own) and exposes keyword-only ``record_*`` methods.
Label values are bounded: model names are registered names (requests for
unknown models are counted under ``model=""``), engines, targets, outcomes
and reasons are small fixed sets.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from compiler.memory import process_tree_resident_bytes
from compiler.store_budget import REMOVAL_REASONS

COMPILE_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
BATCH_SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128)
QUEUE_DELAY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)
RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)

RECOMPILE_REASONS = ("new_model_version", "artifact_missing", "target_or_compiler_changed")
ADMISSION_DECISIONS = {
    "admitted": ("warm", "threshold", "restored"),
    "deferred": ("below_threshold",),
    "refused": ("storm", "cap", "budget", "queue_full"),
    "evicted": ("hotter_bucket",),
}
"""Compile admission's decisions and the reasons each is taken for (see ``compile_admission``)."""


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._before_scrape: list[Callable[[], None]] = []
        r = self.registry
        counter, gauge, histogram = (partial(kind, registry=r) for kind in (Counter, Gauge, Histogram))
        self.compiles = counter(
            "jitserve_compiles_total",
            "Kernel compiles by tier (tvm, tvm-tuned; openvino and its reduced precisions) and outcome "
            "(ok, verify_failed, error).",
            ["model", "target", "tier", "outcome"],
        )
        self.unscheduled = counter(
            "jitserve_unscheduled_kernels_total",
            "Kernels of new compiles that no schedule rule and no tuning record scheduled (naive loops).",
            ["model", "tier"],
        )
        self.recompiles = counter(
            "jitserve_recompiles_total",
            "Compiles of a bucket that had been compiled before, by reason.",
            ["model", "reason"],
        )
        self.store_checks: dict[str, dict[str, int]] = {}
        """The store check's last results by store, as the console shows them."""
        self.store_check = gauge(
            "jitserve_store_check_entries",
            "The store check at start: kernels and models found sound (ok) or damaged (removed or skipped).",
            ["store", "result"],
        )
        self.compile_retries = counter(
            "jitserve_compile_retries_total",
            "Compiles scheduled again after a failure that may pass (child killed, crashed or timed out).",
            ["model"],
        )
        self.compile_duration = histogram(
            "jitserve_compile_duration_seconds",
            "Wall time of one kernel compile (import, build, export).",
            ["model", "target"],
            buckets=COMPILE_BUCKETS,
        )
        self.cache_hits = counter(
            "jitserve_kernel_cache_hits_total",
            "Kernel-routed requests whose kernel was in the in-memory cache.",
            ["model"],
        )
        self.cache_misses = counter(
            "jitserve_kernel_cache_misses_total",
            "Requests whose bucket had no kernel in memory: first seen (compile queued) or evicted (reloaded).",
            ["model"],
        )
        self.kernel_reloads = counter(
            "jitserve_kernel_reloads_total",
            "Kernels loaded from the artifact store instead of compiled.",
            ["model"],
        )
        self.fleet = FleetMetrics(r)
        self.correctness = CorrectnessMetrics(r)
        self.store = StoreMetrics(r)
        self.memory_admission = MemoryAdmissionMetrics(r)
        self.cache_evictions = counter(
            "jitserve_kernel_cache_evictions_total", "Kernels evicted from the in-memory LRU cache."
        )
        self.cache_entries = gauge("jitserve_kernel_cache_entries", "Kernels held in the in-memory cache.")
        self.queue_depth = gauge("jitserve_compile_queue_depth", "Compiles queued or running.")
        self.admissions = counter(
            "jitserve_compile_admissions_total",
            "Compile admission's decisions on cold buckets' requests (admitted, deferred, refused) and "
            "evictions of compiled buckets, by reason.",
            ["model", "decision", "reason"],
        )
        self.shape_storm = gauge(
            "jitserve_shape_storm",
            "1 while a model sees new buckets faster than compile admission allows (no compiles admitted).",
            ["model"],
        )
        self.cold_lane_requests = counter(
            "jitserve_cold_lane_requests_total",
            "Requests to new shapes (buckets that have not earned a compile) run on the idle-priority cold lane.",
            ["model"],
        )
        self.memory = gauge("jitserve_resident_memory_bytes", "Resident memory of the server process itself.")
        self.children_memory = gauge(
            "jitserve_children_resident_memory_bytes",
            "Resident memory of the server's child processes (compiles and tuning), summed.",
        )
        self.before_scrape(self._refresh_memory)
        self.compile_stage_seconds = counter(
            "jitserve_compile_stage_seconds_total",
            "Seconds spent in each stage of kernel compiles (simplify, import, ..., export, verify).",
            ["model", "stage"],
        )
        self.routing = counter(
            "jitserve_routing_decisions_total",
            "Buckets routed to an engine after timing every verified engine.",
            ["model", "engine"],
        )
        self.tuning_trials = counter(
            "jitserve_tuning_trials_total",
            "MetaSchedule trials measured by background tuning.",
            ["model"],
        )
        self.tuning_seconds = counter(
            "jitserve_tuning_seconds_total", "Wall seconds spent in background tuning.", ["model"]
        )
        self.serving = RequestMetrics(r)
        self.padding_waste = histogram(
            "jitserve_padding_waste_ratio",
            "Padded elements / bucket elements per kernel-served request (ONNX Runtime runs unpadded).",
            ["model"],
            buckets=RATIO_BUCKETS,
        )

        self.batch_size = histogram(
            "jitserve_batch_size",
            "Rows (entries along the batch axis) per run of a dynamically batched model.",
            ["model"],
            buckets=BATCH_SIZE_BUCKETS,
        )
        self.batch_queue_delay = histogram(
            "jitserve_batch_queue_delay_seconds",
            "Time a request waited in its model's batching queue before its batch ran.",
            ["model"],
            buckets=QUEUE_DELAY_BUCKETS,
        )

    def record_compile(
        self, *, model: str, target: str, tier: str, outcome: str, seconds: float | None, unscheduled: int = 0
    ) -> None:
        self.compiles.labels(model, target, tier, outcome).inc()
        self.unscheduled.labels(model, tier).inc(unscheduled)
        if seconds is not None:
            self.compile_duration.labels(model, target).observe(seconds)

    def set_store_check(self, *, store: str, ok: int, damaged: int) -> None:
        self.store_check.labels(store, "ok").set(ok)
        self.store_check.labels(store, "damaged").set(damaged)
        self.store_checks[store] = {"ok": ok, "damaged": damaged}

    def record_compile_retry(self, *, model: str, retried: bool = True) -> None:
        """``retried=False`` only shows the model's series (at zero) once it compiles."""
        child = self.compile_retries.labels(model)
        if retried:
            child.inc()

    def record_compile_stages(self, *, model: str, stages: dict[str, float]) -> None:
        for stage, seconds in stages.items():
            self.compile_stage_seconds.labels(model, stage).inc(seconds)

    def record_admission(self, *, model: str, decision: str, reason: str) -> None:
        self.admissions.labels(model, decision, reason).inc()

    def set_shape_storm(self, *, model: str, storm: bool) -> None:
        self.shape_storm.labels(model).set(1 if storm else 0)

    def record_cold_lane(self, *, model: str) -> None:
        self.cold_lane_requests.labels(model).inc()

    def record_recompile(self, *, model: str, reason: str) -> None:
        self.recompiles.labels(model, reason).inc()

    def record_routing(self, *, model: str, engine: str) -> None:
        self.routing.labels(model, engine).inc()

    def record_tuning(self, *, model: str, trials: int, seconds: float) -> None:
        self.tuning_trials.labels(model).inc(trials)
        self.tuning_seconds.labels(model).inc(seconds)

    def record_cache_lookup(self, *, model: str, hit: bool) -> None:
        (self.cache_hits if hit else self.cache_misses).labels(model).inc()

    def record_reload(self, *, model: str) -> None:
        self.kernel_reloads.labels(model).inc()

    def record_eviction(self) -> None:
        self.cache_evictions.inc()

    def set_cache_entries(self, *, entries: int) -> None:
        self.cache_entries.set(entries)

    def set_queue_depth(self, *, depth: int) -> None:
        self.queue_depth.set(depth)

    def record_padding(self, *, model: str, waste: float) -> None:
        self.padding_waste.labels(model).observe(waste)

    def record_batch(self, *, model: str, rows: int, waits: list[float]) -> None:
        self.batch_size.labels(model).observe(rows)
        delay = self.batch_queue_delay.labels(model)
        for seconds in waits:
            delay.observe(seconds)

    def before_scrape(self, refresh: Callable[[], None]) -> None:
        """Call ``refresh`` before every exposition: for gauges whose truth changes with time alone."""
        self._before_scrape.append(refresh)

    def _refresh_memory(self) -> None:
        server, children = process_tree_resident_bytes()
        self.memory.set(server)
        self.children_memory.set(children)

    def exposition(self) -> bytes:
        for refresh in self._before_scrape:
            refresh()
        return generate_latest(self.registry)


class CorrectnessMetrics:
    """The guards that keep a kernel's wrong answer from being served: the padding gate before routing,
    and shadow checks of served answers against ONNX Runtime."""

    def __init__(self, registry: CollectorRegistry) -> None:
        counter = partial(Counter, registry=registry)
        self.gate_refusals = counter(
            "jitserve_padding_gate_refusals_total",
            "Kernels kept off a bucket because their answer to its most padded request differed from "
            "ONNX Runtime's on the exact request.",
            ["model"],
        )
        self.verdicts_revised = counter(
            "jitserve_padding_verdicts_revised_total",
            "Axes found unsafe to pad after upload (by the padding gate), for every bucket of the model.",
            ["model"],
        )
        self.shadow_checks = counter(
            "jitserve_shadow_checks_total",
            "Requests served by a compiled kernel and run again on ONNX Runtime off the hot path, by outcome "
            "(match, mismatch, dropped: the shadow queue was full or the rate cap reached, error: ONNX Runtime "
            "failed).",
            ["model", "outcome"],
        )
        self.shadow_demotions = counter(
            "jitserve_shadow_demotions_total",
            "Kernels taken off their bucket because a shadow check found a served answer wrong.",
            ["model"],
        )

    def record_gate_refusal(self, *, model: str, revised_axes: int) -> None:
        self.gate_refusals.labels(model).inc()
        self.verdicts_revised.labels(model).inc(revised_axes)

    def record_shadow_check(self, *, model: str, outcome: str) -> None:
        self.shadow_checks.labels(model, outcome).inc()

    def record_shadow_demotion(self, *, model: str) -> None:
        self.shadow_demotions.labels(model).inc()


class FleetMetrics:
    """The metrics of replicas sharing one store: builds waited for, leases taken over, changes followed."""

    def __init__(self, registry: CollectorRegistry) -> None:
        counter, histogram = (partial(kind, registry=registry) for kind in (Counter, Histogram))
        self.peer_builds = counter(
            "jitserve_kernels_built_by_peers_total",
            "Kernels this replica waited for while another process on the shared store built them (by tier).",
            ["tier"],
        )
        self.peer_wait = histogram(
            "jitserve_peer_build_wait_seconds",
            "How long a compile waited for another process on the shared store to build the same kernel.",
            buckets=COMPILE_BUCKETS,
        )
        self.lease_takeovers = counter(
            "jitserve_compile_lease_takeovers_total",
            "Kernels built here after the process holding their build lease ended without one (died or failed).",
        )
        self.store_follows = counter(
            "jitserve_model_store_follows_total",
            "Changes another replica made to the shared model store that this one followed "
            "(new_model, new_version, deleted).",
            ["change"],
        )
        for tier in ("tvm", "tvm-tuned"):  # zero before the first one: a dashboard shows 0, not "no data"
            self.peer_builds.labels(tier)
        for change in ("new_model", "new_version", "deleted"):
            self.store_follows.labels(change)

    def record_peer_build(self, *, tier: str, seconds: float) -> None:
        self.peer_builds.labels(tier).inc()
        self.peer_wait.observe(seconds)

    def record_lease_takeover(self) -> None:
        self.lease_takeovers.inc()

    def record_store_follow(self, *, change: str) -> None:
        self.store_follows.labels(change).inc()


class StoreMetrics:
    """The artifact store's size against its budget, and what the budget removed."""

    def __init__(self, registry: CollectorRegistry) -> None:
        counter, gauge = (partial(kind, registry=registry) for kind in (Counter, Gauge))
        self.bytes = gauge(
            "jitserve_kernel_store_bytes",
            "Bytes of the artifact store (kernels and prepared weights) after the last budget sweep.",
        )
        self.removals = counter(
            "jitserve_kernel_store_removals_total",
            "Entries the store's budget removed, by kind (kernel, weights) and reason (unreferenced: a deleted "
            "model's or superseded version's; least_recently_used).",
            ["kind", "reason"],
        )
        self.removed_bytes = counter(
            "jitserve_kernel_store_removed_bytes_total",
            "Bytes the store's budget removed, by kind and reason.",
            ["kind", "reason"],
        )
        for kind in ("kernel", "weights"):  # zero before the first one: a dashboard shows 0, not "no data"
            for reason in REMOVAL_REASONS:
                self.removals.labels(kind, reason)
                self.removed_bytes.labels(kind, reason)

    def set_bytes(self, *, total: int) -> None:
        self.bytes.set(total)

    def record_removal(self, *, kind: str, reason: str, size: int) -> None:
        self.removals.labels(kind, reason).inc()
        self.removed_bytes.labels(kind, reason).inc(size)


class MemoryAdmissionMetrics:
    """The memory limit uploads are admitted against, the weights held, and the uploads refused."""

    def __init__(self, registry: CollectorRegistry) -> None:
        counter, gauge = (partial(kind, registry=registry) for kind in (Counter, Gauge))
        self.limit = gauge(
            "jitserve_memory_limit_bytes",
            "The memory uploads are admitted against (JITSERVE_MEMORY_BYTES, else the container's limit).",
        )
        self.weights = gauge(
            "jitserve_weights_bytes",
            "Bytes of model weights mapped for the kernels, once per model version, shared by its buckets.",
        )
        self.refusals = counter(
            "jitserve_uploads_refused_for_memory_total",
            "Uploads refused (507) because their weights would not fit in memory beside the served models.",
        )

    def set_limit(self, *, limit: int) -> None:
        self.limit.set(limit)

    def set_weights(self, *, total: int) -> None:
        self.weights.set(total)

    def record_refusal(self) -> None:
        self.refusals.inc()


class RequestMetrics:
    """Predictions and gRPC calls: by model, engine, status and protocol."""

    def __init__(self, r: CollectorRegistry) -> None:
        counter, histogram = (partial(kind, registry=r) for kind in (Counter, Histogram))
        self._request_children: dict[tuple[str, str, int, str], tuple[Counter, Histogram]] = {}
        self.requests = counter(
            "jitserve_requests_total",
            "Prediction requests by model, serving engine, HTTP status (a gRPC call counts the status the same "
            "error has over REST) and protocol (rest, grpc).",
            ["model", "engine", "code", "protocol"],
        )
        self.grpc_calls = counter(
            "jitserve_grpc_calls_total",
            "gRPC calls by method (ModelInfer, ServerReady, ...) and status code (OK, INVALID_ARGUMENT, ...).",
            ["method", "code"],
        )
        self.dynamic_requests = counter(
            "jitserve_dynamic_requests_total",
            "Prediction requests to buckets of the dynamic tier (a symbolic kernel per size range), by engine.",
            ["model", "engine"],
        )
        self.request_duration = histogram(
            "jitserve_request_duration_seconds",
            "Prediction latency inside the server, by engine and protocol.",
            ["model", "engine", "protocol"],
            buckets=LATENCY_BUCKETS,
        )

    def record_request(
        self,
        *,
        model: str,
        engine: str,
        code: int,
        seconds: float | None = None,
        dynamic: bool = False,
        protocol: str = "rest",
    ) -> None:
        # The labelled children are looked up once: labels() takes a lock and costs more than a tiny model's run.
        key = (model, engine, code, protocol)
        children = self._request_children.get(key)
        if children is None:
            children = self._request_children[key] = (
                self.requests.labels(model, engine, str(code), protocol),
                self.request_duration.labels(model, engine, protocol),
            )
        children[0].inc()
        if dynamic:
            self.dynamic_requests.labels(model, engine).inc()
        if seconds is not None:
            children[1].observe(seconds)

    def record_grpc_call(self, *, method: str, code: str) -> None:
        self.grpc_calls.labels(method, code).inc()
