"""Loaded kernels: an in-memory LRU bounded by entries and by bytes, in front
of the artifact store.

An evicted kernel stays in the artifact store: needing it again is a reload
(milliseconds), never a compile.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from compiler.engines import Engine, TvmEngine
from compiler.signature import Signature
from compiler.store import ArtifactStore
from compiler.target import target_kind

from .metrics import Metrics

EngineOpener = Callable[[Path, Signature, dict], Engine]


class KernelCache:
    def __init__(
        self,
        max_entries: int,
        max_bytes: int,
        *,
        on_evict: Callable[[str], None] = lambda key: None,
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._on_evict = on_evict
        self._entries: OrderedDict[str, tuple[Engine, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> Engine | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: str, engine: Engine, size: int) -> None:
        evicted = []
        with self._lock:
            if key in self._entries:
                self._bytes -= self._entries.pop(key)[1]
            self._entries[key] = (engine, size)
            self._bytes += size
            # Keep at least the newest kernel even if it alone exceeds max_bytes.
            while len(self._entries) > 1 and (len(self._entries) > self.max_entries or self._bytes > self.max_bytes):
                old_key, (_, old_size) = self._entries.popitem(last=False)
                self._bytes -= old_size
                evicted.append(old_key)
        for old_key in evicted:
            self._on_evict(old_key)

    def discard(self, key: str) -> None:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._bytes -= entry[1]

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    @property
    def total_bytes(self) -> int:
        return self._bytes


def open_tvm_engine(library: Path, signature: Signature, target: dict) -> Engine:
    return TvmEngine(library, signature.input_names, signature.output_names, device=target_kind(target))


class Kernels:
    """Kernels by artifact key: from the cache, else loaded from the store (a reload, never a compile)."""

    def __init__(
        self,
        cache: KernelCache,
        artifacts: ArtifactStore,
        metrics: Metrics,
        open_engine: EngineOpener = open_tvm_engine,
    ) -> None:
        self.cache = cache
        self.artifacts = artifacts
        self.metrics = metrics
        self._open_engine = open_engine

    def get(self, key: str) -> Engine | None:
        return self.cache.get(key)

    def open(self, key: str, signature: Signature, target: dict) -> Engine:
        """A private instance of a stored kernel, outside the cache (routing times these)."""
        return self._open_engine(self.artifacts.library_path(key), signature, target)

    def load(self, key: str, signature: Signature, target: dict) -> Engine:
        engine = self.open(key, signature, target)
        manifest = self.artifacts.get(key)
        self.cache.put(key, engine, manifest.library_bytes if manifest else 0)
        self.metrics.set_cache_entries(entries=len(self.cache))
        return engine
