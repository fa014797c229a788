"""Memory: the limit uploads are admitted against, the weights held, refusals, and what the server and
its children hold."""

from __future__ import annotations

from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge

from compiler.models.memory import process_tree_resident_bytes


class MemoryMetrics:
    """The memory limit uploads are admitted against, the weights held, the uploads refused, and the
    resident memory of the server and of its children."""

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
        self.resident = gauge("jitserve_resident_memory_bytes", "Resident memory of the server process itself.")
        self.children_resident = gauge(
            "jitserve_children_resident_memory_bytes",
            "Resident memory of the server's child processes (compiles and tuning), summed.",
        )
        self.refusals = counter(
            "jitserve_uploads_refused_for_memory_total",
            "Uploads refused (507) because their weights would not fit in memory beside the served models; also "
            "OpenVINO builds and generate sequences (503) refused for the memory they would take.",
        )

    def set_limit(self, *, limit: int) -> None:
        self.limit.set(limit)

    def set_weights(self, *, total: int) -> None:
        self.weights.set(total)

    def record_refusal(self) -> None:
        self.refusals.inc()

    def refresh_resident(self) -> None:
        server, children = process_tree_resident_bytes()
        self.resident.set(server)
        self.children_resident.set(children)
