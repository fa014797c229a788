"""The kernel store's budget: its bytes, and what it removed and why."""

from __future__ import annotations

from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge

from compiler.storage.store_budget import REMOVAL_REASONS


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
