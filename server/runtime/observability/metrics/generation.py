"""Generative decoding: time to first token, the time between tokens, tokens made, sequences running and
waiting, and the key/value cache's blocks in use."""

from __future__ import annotations

from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

FIRST_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class GenerationMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        counter, gauge, histogram = (partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram))
        self.first_token = histogram(
            "jitserve_generate_time_to_first_token_seconds",
            "From a generate request's arrival to its first token (queueing and prefill).",
            ["model"],
            buckets=FIRST_TOKEN_BUCKETS,
        )
        self.inter_token = histogram(
            "jitserve_generate_inter_token_seconds",
            "Between two tokens of one sequence (one decode step of the running batch).",
            ["model"],
            buckets=INTER_TOKEN_BUCKETS,
        )
        self.tokens = counter("jitserve_generated_tokens_total", "Tokens generated.", ["model"])
        self.sequences = counter(
            "jitserve_generate_sequences_total",
            "Sequences ended, by why (stop, length, cancelled, error).",
            ["model", "finish_reason"],
        )
        self.running = gauge("jitserve_generate_running_sequences", "Sequences in the running batch.", ["model"])
        self.waiting = gauge("jitserve_generate_waiting_sequences", "Sequences waiting to join the batch.", ["model"])
        self.cache_blocks = gauge(
            "jitserve_kv_cache_blocks_used", "Key/value cache blocks reserved by sequences.", ["model"]
        )
        self.batch_size = histogram(
            "jitserve_generate_step_batch_size",
            "Sequences decoded together in one step.",
            ["model"],
            buckets=(1, 2, 4, 8, 16, 32, 64),
        )

    def record_first_token(self, *, model: str, seconds: float) -> None:
        self.first_token.labels(model).observe(seconds)
        self.tokens.labels(model).inc()

    def record_step(self, *, model: str, batch: int, gaps: list[float]) -> None:
        """One decode step of ``batch`` sequences; ``gaps``: each one's time since its previous token."""
        self.batch_size.labels(model).observe(batch)
        self.tokens.labels(model).inc(len(gaps))
        for gap in gaps:
            self.inter_token.labels(model).observe(gap)

    def record_end(self, *, model: str, finish_reason: str) -> None:
        self.sequences.labels(model, finish_reason).inc()

    def set_state(self, *, model: str, running: int, waiting: int, cache_blocks: int) -> None:
        self.running.labels(model).set(running)
        self.waiting.labels(model).set(waiting)
        self.cache_blocks.labels(model).set(cache_blocks)
