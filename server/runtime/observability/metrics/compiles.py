"""Compiles and what decides them: each compile (by tier and outcome), its stages, retries and
recompiles, compile admission's decisions and shape storms, the queue, routing, background tuning."""

from __future__ import annotations

from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

COMPILE_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200)
RECOMPILE_REASONS = ("new_model_version", "artifact_missing", "target_or_compiler_changed")
ADMISSION_DECISIONS = {
    "admitted": ("warm", "threshold", "restored"),
    "deferred": ("below_threshold", "padding_probe"),
    "refused": ("storm", "cap", "budget", "queue_full"),
    "evicted": ("hotter_bucket",),
}
"""Compile admission's decisions and the reasons each is taken for (see ``compile_admission``)."""


class CompileMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        counter, gauge, histogram = (partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram))
        self.compiles = counter(
            "jitserve_compiles_total",
            "TVM kernel compiles by tier (tvm, tvm-tuned) and outcome (ok, verify_failed, error).",
            ["model", "target", "tier", "outcome"],
        )
        self.openvino_compiles = counter(
            "jitserve_openvino_compiles_total",
            "OpenVINO compiles of a model version (once per version and precision, for all its buckets), by "
            "outcome (ok, error).",
            ["model", "precision", "outcome"],
        )
        self.openvino_builds = counter(
            "jitserve_openvino_bucket_builds_total",
            "A bucket's OpenVINO engine (an infer request on the version's compiled model) built and verified, "
            "by engine (openvino, openvino-bf16, ...) and outcome (ok, verify_failed, error).",
            ["model", "engine", "outcome"],
        )
        self.openvino_duration = histogram(
            "jitserve_openvino_compile_duration_seconds",
            "Wall time of one OpenVINO compile of a model version.",
            ["model"],
            buckets=COMPILE_BUCKETS,
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
        self.retries = counter(
            "jitserve_compile_retries_total",
            "Compiles scheduled again after a failure that may pass (child killed, crashed or timed out).",
            ["model"],
        )
        self.duration = histogram(
            "jitserve_compile_duration_seconds",
            "Wall time of one kernel compile (import, build, export).",
            ["model", "target"],
            buckets=COMPILE_BUCKETS,
        )
        self.stage_seconds = counter(
            "jitserve_compile_stage_seconds_total",
            "Seconds spent in each stage of kernel compiles (simplify, import, ..., export, verify).",
            ["model", "stage"],
        )
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

    def record_compile(
        self, *, model: str, target: str, tier: str, outcome: str, seconds: float | None, unscheduled: int = 0
    ) -> None:
        self.compiles.labels(model, target, tier, outcome).inc()
        self.unscheduled.labels(model, tier).inc(unscheduled)
        if seconds is not None:
            self.duration.labels(model, target).observe(seconds)

    def record_openvino_compile(self, *, model: str, precision: str, outcome: str, seconds: float) -> None:
        self.openvino_compiles.labels(model, precision, outcome).inc()
        self.openvino_duration.labels(model).observe(seconds)

    def record_openvino_build(self, *, model: str, engine: str, outcome: str) -> None:
        self.openvino_builds.labels(model, engine, outcome).inc()

    def record_retry(self, *, model: str, retried: bool = True) -> None:
        """``retried=False`` only shows the model's series (at zero) once it compiles."""
        child = self.retries.labels(model)
        if retried:
            child.inc()

    def record_stages(self, *, model: str, stages: dict[str, float]) -> None:
        for stage, seconds in stages.items():
            self.stage_seconds.labels(model, stage).inc(seconds)

    def record_recompile(self, *, model: str, reason: str) -> None:
        self.recompiles.labels(model, reason).inc()

    def set_queue_depth(self, *, depth: int) -> None:
        self.queue_depth.set(depth)

    def record_admission(self, *, model: str, decision: str, reason: str) -> None:
        self.admissions.labels(model, decision, reason).inc()

    def set_shape_storm(self, *, model: str, storm: bool) -> None:
        self.shape_storm.labels(model).set(1 if storm else 0)

    def record_routing(self, *, model: str, engine: str) -> None:
        self.routing.labels(model, engine).inc()

    def record_tuning(self, *, model: str, trials: int, seconds: float) -> None:
        self.tuning_trials.labels(model).inc(trials)
        self.tuning_seconds.labels(model).inc(seconds)
