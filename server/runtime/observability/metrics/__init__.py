"""Every jitserve metric, defined in this package: one module per subsystem, one calling style.

One :class:`Metrics` object owns its own registry (no globals, so each app and each test has its own)
and holds one object per subsystem, each with keyword-only ``record_*`` and ``set_*`` methods:
``metrics.compiles.record_compile(...)``, ``metrics.serving.record_request(...)``. Label values are
bounded: model names are registered names (requests for unknown models are counted under
``model=""``), engines, targets, outcomes and reasons are small fixed sets.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .compiles import CompileMetrics
from .correctness import CorrectnessMetrics
from .fleet import FleetMetrics
from .generation import GenerationMetrics
from .kernels import KernelMetrics
from .memory import MemoryMetrics
from .serving import RequestMetrics
from .store import StoreMetrics


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        self._before_scrape: list[Callable[[], None]] = []
        self.compiles = CompileMetrics(registry)
        """Compiles, their admission and queue, routing, tuning."""
        self.kernels = KernelMetrics(registry)
        """The kernel cache and the store check."""
        self.serving = RequestMetrics(registry)
        """Requests, their latency, the cold lane, padding, batches."""
        self.correctness = CorrectnessMetrics(registry)
        self.fleet = FleetMetrics(registry)
        self.store = StoreMetrics(registry)
        self.memory = MemoryMetrics(registry)
        self.generation = GenerationMetrics(registry)
        """Generative decoding: first token, between tokens, sequences, the key/value cache."""
        self.before_scrape(self.memory.refresh_resident)

    def before_scrape(self, refresh: Callable[[], None]) -> None:
        """Call ``refresh`` before every exposition: for gauges whose truth changes with time alone."""
        self._before_scrape.append(refresh)

    def exposition(self) -> bytes:
        for refresh in self._before_scrape:
            refresh()
        return generate_latest(self.registry)
