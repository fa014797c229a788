"""Keeps the artifact store within ``kernel_store_bytes``: a background sweep
that tells the store what is still referenced and in use, and removes the
rest in the order :mod:`compiler.storage.store_budget` sets (kernels of deleted models
and superseded versions first, after a grace period; then the least recently
used). Every replica on a shared store sweeps; a kernel any of them holds in
memory is touched at each sweep and so never looks idle."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from compiler.storage.store import KernelStore
from compiler.storage.store_budget import Removal, enforce_budget

from ...settings import Settings
from ..observability.metrics import Metrics
from .periodic import Periodic
from .records import ModelStore
from .registry import ServedModel

log = logging.getLogger("jitserve")


class StoreJanitor:
    def __init__(
        self,
        settings: Settings,
        artifacts: KernelStore,
        models: ModelStore,
        *,
        served: Callable[[], list[ServedModel]],
        in_use: Callable[[], set[str]],
        metrics: Metrics,
    ) -> None:
        """``served`` lists the models served here; ``in_use`` the kernel keys loaded in memory here."""
        self.artifacts = artifacts
        self.models = models
        self.served = served
        self.in_use = in_use
        self.metrics = metrics
        self.budget_bytes = settings.kernel_store_bytes
        self.grace_seconds = settings.kernel_store_grace_seconds
        self.interval = settings.kernel_store_sweep_seconds
        self._lock = threading.Lock()
        self._periodic = Periodic("store-sweep", self.sweep, self.interval, at_start=True)

    def start(self) -> None:
        self._periodic.start()

    def stop(self) -> None:
        self._periodic.stop()

    def referenced(self) -> tuple[set[str], set[str]]:
        """Kernel keys and weight folders (model digests) of the versions stored or served now."""
        kernels: set[str] = set()
        weights: set[str] = set()
        for record in self.models.current_records():
            weights.add(record.digest)
            for bucket in record.buckets.values():
                kernels.update(bucket.stored_keys)
        for served in self.served():
            weights.add(served.record.digest)
            for bucket in served.all_buckets():
                kernels.update(bucket.stored_keys)
        return kernels, weights

    def sweep(self) -> list[Removal]:
        """One pass: remove what the budget asks for; count, log and report the store's size."""
        with self._lock:  # a sweep at a time in this process
            kernels, weights = self.referenced()
            removed, remaining = enforce_budget(
                self.artifacts,
                self.budget_bytes,
                referenced_kernels=kernels,
                referenced_weights=weights,
                in_use=self.in_use(),
                grace_seconds=self.grace_seconds,
            )
        for removal in removed:
            entry = removal.entry
            self.metrics.store.record_removal(kind=entry.kind, reason=removal.reason, size=entry.bytes)
            log.info(
                "kernel store: removed %s %s (%d bytes, %s) to stay within %d bytes",
                entry.kind, entry.name[:16], entry.bytes, removal.reason.replace("_", " "), self.budget_bytes,
            )  # fmt: skip
        if remaining > self.budget_bytes:
            log.warning(
                "kernel store holds %d bytes, over its budget of %d: the rest is in use or referenced weights",
                remaining, self.budget_bytes,
            )  # fmt: skip
        self.metrics.store.set_bytes(total=remaining)
        return removed
