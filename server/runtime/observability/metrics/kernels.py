"""Kernels in memory and in the store: cache hits and misses, reloads instead of compiles, evictions,
entries held, and the store check at start."""

from __future__ import annotations

from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge


class KernelMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        counter, gauge = (partial(kind, registry=registry) for kind in (Counter, Gauge))
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
        self.reloads = counter(
            "jitserve_kernel_reloads_total",
            "Kernels loaded from the artifact store instead of compiled.",
            ["model"],
        )
        self.evictions = counter(
            "jitserve_kernel_cache_evictions_total", "Kernels evicted from the in-memory LRU cache."
        )
        self.entries = gauge("jitserve_kernel_cache_entries", "Kernels held in the in-memory cache.")
        self.store_check = gauge(
            "jitserve_store_check_entries",
            "The store check at start: kernels and models found sound (ok) or damaged (removed or skipped).",
            ["store", "result"],
        )
        self.store_checks: dict[str, dict[str, int]] = {}
        """The store check's last results by store, as the console shows them."""

    def record_lookup(self, *, model: str, hit: bool) -> None:
        (self.cache_hits if hit else self.cache_misses).labels(model).inc()

    def record_reload(self, *, model: str) -> None:
        self.reloads.labels(model).inc()

    def record_eviction(self) -> None:
        self.evictions.inc()

    def set_entries(self, *, entries: int) -> None:
        self.entries.set(entries)

    def set_store_check(self, *, store: str, ok: int, damaged: int) -> None:
        self.store_check.labels(store, "ok").set(ok)
        self.store_check.labels(store, "damaged").set(damaged)
        self.store_checks[store] = {"ok": ok, "damaged": damaged}
