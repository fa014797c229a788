"""Requests: predictions and gRPC calls (by model, engine, status, protocol), their latency, their wait for
an inference thread, the cold lane, padding waste and dynamic batches."""

from __future__ import annotations

from functools import partial

from prometheus_client import CollectorRegistry, Counter, Histogram

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
BATCH_SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128)
QUEUE_DELAY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)
RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class RequestMetrics:
    """Predictions and gRPC calls: by model, engine, status and protocol; the cold lane, padding waste and
    dynamic batches."""

    def __init__(self, r: CollectorRegistry) -> None:
        counter, histogram = (partial(kind, registry=r) for kind in (Counter, Histogram))
        self.cold_lane_requests = counter(
            "jitserve_cold_lane_requests_total",
            "Requests to new shapes (buckets that have not earned a compile) run on the idle-priority cold lane.",
            ["model"],
        )
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
        self.inference_queue_wait = histogram(
            "jitserve_inference_queue_seconds",
            "Time a model's run waited for an inference thread (its lane of the fair queue; 'shared': work of no "
            "one model).",
            ["model"],
            buckets=QUEUE_DELAY_BUCKETS,
        )
        self._queue_children: dict[str, Histogram] = {}
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

    def record_queue_wait(self, model: str, seconds: float) -> None:
        child = self._queue_children.get(model)
        if child is None:
            child = self._queue_children[model] = self.inference_queue_wait.labels(model)
        child.observe(seconds)

    def record_grpc_call(self, *, method: str, code: str) -> None:
        self.grpc_calls.labels(method, code).inc()

    def record_cold_lane(self, *, model: str) -> None:
        self.cold_lane_requests.labels(model).inc()

    def record_padding(self, *, model: str, waste: float) -> None:
        self.padding_waste.labels(model).observe(waste)

    def record_batch(self, *, model: str, rows: int, waits: list[float]) -> None:
        self.batch_size.labels(model).observe(rows)
        delay = self.batch_queue_delay.labels(model)
        for seconds in waits:
            delay.observe(seconds)
