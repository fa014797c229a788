"""The guards against wrong answers: the padding probe, the padding gate and the shadow checks."""

from __future__ import annotations

from functools import partial

from prometheus_client import CollectorRegistry, Counter, Histogram

PROBE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)


class CorrectnessMetrics:
    """The guards that keep a kernel's wrong answer from being served: the padding probe after upload, the
    padding gate before routing, and shadow checks of served answers against ONNX Runtime."""

    def __init__(self, registry: CollectorRegistry) -> None:
        counter = partial(Counter, registry=registry)
        self.padding_probe_seconds = Histogram(
            "jitserve_padding_probe_seconds",
            "Wall time of a model version's padding probe, run after its upload answered, by outcome (done: "
            "its verdicts in force; failed: its axes served exactly).",
            ["model", "outcome"],
            buckets=PROBE_BUCKETS,
            registry=registry,
        )
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

    def record_padding_probe(self, *, model: str, outcome: str, seconds: float) -> None:
        self.padding_probe_seconds.labels(model, outcome).observe(seconds)

    def record_gate_refusal(self, *, model: str, revised_axes: int) -> None:
        self.gate_refusals.labels(model).inc()
        self.verdicts_revised.labels(model).inc(revised_axes)

    def record_shadow_check(self, *, model: str, outcome: str) -> None:
        self.shadow_checks.labels(model, outcome).inc()

    def record_shadow_demotion(self, *, model: str) -> None:
        self.shadow_demotions.labels(model).inc()
