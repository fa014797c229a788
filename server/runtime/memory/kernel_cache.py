"""Loaded kernels: an in-memory LRU bounded by entries and by bytes, in front
of the artifact store, and the weights they run with.

A kernel is code only: it runs with its model version's prepared weights,
mapped from the store once per version and shared by every bucket's kernel
(:class:`WeightPool`). A cache entry is a kernel bound to one version's
weights, so two versions (or two models) of one architecture share the
stored kernel and each run with their own weights.

An evicted kernel stays in the artifact store: needing it again is a reload
(milliseconds), never a compile.
"""

from __future__ import annotations

import hashlib
import mmap
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from pathlib import Path

import numpy as np

from compiler.building.target import target_kind
from compiler.errors import CompileError
from compiler.models.signature import Signature
from compiler.models.weights import load_weights
from compiler.running.engines import Engine, TransformedWeights, TvmEngine, device_weights
from compiler.storage.store import KernelStore, Manifest
from compiler.storage.store_budget import touch

from ..compiling.openvino_builds import KEY_PREFIX as OPENVINO_KEY_PREFIX
from ..compiling.openvino_builds import OpenVinoBuilds
from ..models.registry import ServedModel
from ..observability.metrics import Metrics

EngineOpener = Callable[[Path, Signature, dict, list], Engine]
CacheKey = tuple[str, str]
"""(kernel key in the store, model version digest): one stored kernel bound to one version's weights."""


class KernelCache:
    def __init__(
        self,
        max_entries: int,
        max_bytes: int,
        *,
        on_evict: Callable[[Hashable], None] = lambda key: None,
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._on_evict = on_evict
        self._entries: OrderedDict[Hashable, tuple[Engine, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Engine | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: Hashable, engine: Engine, size: int) -> None:
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

    def discard(self, key: Hashable) -> None:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._bytes -= entry[1]

    def discard_where(self, matches: Callable[[Hashable], bool]) -> int:
        """Drop every entry whose key matches; returns how many."""
        with self._lock:
            doomed = [key for key in self._entries if matches(key)]
            for key in doomed:
                self._bytes -= self._entries.pop(key)[1]
        return len(doomed)

    def __len__(self) -> int:
        return len(self._entries)

    def cached_keys(self) -> list[Hashable]:
        with self._lock:
            return list(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    @property
    def total_bytes(self) -> int:
        return self._bytes


def kernel_memory(manifest: Manifest) -> int:
    return manifest.library_bytes + (manifest.workspace_bytes or 0)


def open_tvm_engine(library: Path, signature: Signature, target: dict, weights: list) -> Engine:
    loaded = getattr(weights, "loaded", None)
    return TvmEngine(
        library,
        signature.input_names,
        signature.output_names,
        device=target_kind(target),
        weights=weights,
        transformed=loaded.transformed if loaded is not None else None,
        weight_outputs=getattr(weights, "outputs", None),
    )


class LoadedWeights:
    """One model version's prepared weights as TVM tensors over the mapped files (on a GPU, copies), and
    what its kernels' transforms computed from them, at most ``max_transformed_ratio`` times their bytes."""

    def __init__(self, directory: Path, device: str, max_transformed_ratio: float = 0.0) -> None:
        arrays = load_weights(directory)
        self.tensors = dict(zip(arrays, device_weights(list(arrays.values()), device), strict=True))
        self.pages = MappedPages(arrays, self.tensors)
        self.prepared_bytes = sum(array.nbytes for array in arrays.values())
        # What the bound is a multiple of: an int8 weight counted as the int16 pairs its panels hold (AVX2's
        # vpmaddwd), the one layout its kernels read it in, as a float weight's panels are its own size.
        self.bound_base = sum(array.nbytes * (2 if array.dtype.itemsize == 1 else 1) for array in arrays.values())
        self.max_transformed_ratio = max_transformed_ratio
        # Blocked conv weights, matmul panels and the like, once per distinct output of the kernels' transforms.
        self.transformed = TransformedWeights(computed=self.pages.give_back_consumed if device != "cuda" else None)

    @property
    def nbytes(self) -> int:
        return self.pages.nbytes + self.transformed.nbytes

    def for_kernel(self, manifest: Manifest) -> KernelWeights:
        """The weights a kernel takes, in its order; a kernel naming another set is refused, and so is one
        whose transform would take the version's transformed weights past their bound."""
        missing = [name for name in manifest.weights if name not in self.tensors]
        if missing:
            raise CompileError(f"kernel {manifest.key[:16]} takes weights this model version lacks: {missing[:3]}")
        if manifest.weight_outputs is None:
            self.pages.reading_as_is(manifest.weights)
            return KernelWeights([self.tensors[name] for name in manifest.weights], self)
        # An output's digest names its parameters by position: the same digest is the same weight only for
        # kernels that take the same weights in the same order.
        order = hashlib.sha256("\n".join(manifest.weights).encode()).hexdigest()[:16]
        outputs = [{**fact, "digest": f"{order}-{fact['digest']}"} for fact in manifest.weight_outputs]
        self._check_bound(manifest, outputs)
        return KernelWeights([self.tensors[name] for name in manifest.weights], self, outputs)

    def _check_bound(self, manifest: Manifest, outputs: list[dict]) -> None:
        adding = self.transformed.missing_bytes(outputs)
        bound = self.max_transformed_ratio * self.bound_base
        if not self.max_transformed_ratio or not adding or self.transformed.nbytes + adding <= bound:
            return
        mib = 2**20
        raise CompileError(
            f"kernel {manifest.key[:16]} reads its weights in a layout of its own ({adding / mib:.0f} MiB more); "
            f"the version's transformed weights would take {(self.transformed.nbytes + adding) / mib:.0f} MiB, past "
            f"{self.max_transformed_ratio:g}x its {self.bound_base / mib:.0f} MiB of weights "
            "(int8 ones counted as int16; JITSERVE_MAX_TRANSFORMED_WEIGHTS_RATIO)"
        )

    def describe(self) -> dict:
        transformed = self.transformed.nbytes
        return {
            "prepared_bytes": self.prepared_bytes,
            "resident_bytes": self.pages.nbytes,
            "transformed_bytes": transformed,
            "transformed_ratio": round(transformed / self.prepared_bytes, 3) if self.prepared_bytes else 0.0,
            "transformed_outputs": self.transformed.count,
        }


class MappedPages:
    """Which of a version's mapped weights are resident. A weight a lifted transform consumed (a matmul's,
    now read from the panels computed from it) is read by no kernel afterwards unless one takes it as it
    is: its pages are given back as the transform ends, so that the panels are no second copy of it in
    memory. Mapped copy-on-write and never written, it reads the same from the file if needed again.
    (Apart from :class:`LoadedWeights`: the transform's callback must not hold the weights alive.)"""

    def __init__(self, arrays: dict[str, np.ndarray], tensors: dict) -> None:
        self._arrays = arrays
        self._names = {tensor.data_ptr(): name for name, tensor in tensors.items()}
        self._read_as_is: set[str] = set()  # by some kernel's main, untransformed
        self._given_back: set[str] = set()
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(array.nbytes for name, array in self._arrays.items() if name not in self._given_back)

    def reading_as_is(self, names) -> None:
        with self._lock:
            self._read_as_is.update(names)
            self._given_back.difference_update(names)

    def give_back_consumed(self, weights: list, results: list) -> None:
        passed = {tensor.data_ptr() for tensor in results}
        ours = [(self._names[t.data_ptr()], t.data_ptr() in passed) for t in weights if t.data_ptr() in self._names]
        self.reading_as_is(name for name, as_is in ours if as_is)
        with self._lock:
            for name, as_is in ours:
                if not as_is and name not in self._read_as_is and release_pages(self._arrays[name]):
                    self._given_back.add(name)


def release_pages(array: np.ndarray) -> bool:
    """Drop a mapped array's resident pages (the next read faults them in from the file again)."""
    mapping = getattr(array, "_mmap", None)
    if mapping is None or not hasattr(mapping, "madvise"):
        return False
    mapping.madvise(mmap.MADV_DONTNEED)
    return True


class KernelWeights(list):
    """A kernel's weight tensors, in its order, holding the version's :class:`LoadedWeights`: the pool
    keeps them (weakly) only while some kernel holds them, and every bucket loaded meanwhile shares them.
    Without it the pool lost them as soon as the first kernel was opened, and each bucket mapped and
    wrapped the weights again (measured: +1x the weights' bytes of RSS per bucket)."""

    def __init__(self, tensors: list, loaded: LoadedWeights, outputs: list[dict] | None = None) -> None:
        super().__init__(tensors)
        self.loaded = loaded
        self.outputs = outputs  # the digest and bytes of each output of the kernel's weight transform


class WeightPool:
    """Each model version's weights loaded once, shared by its kernels, gone with the last of them."""

    def __init__(self, artifacts: KernelStore, max_transformed_ratio: float = 0.0) -> None:
        self.artifacts = artifacts
        self.max_transformed_ratio = max_transformed_ratio
        self._loaded: weakref.WeakValueDictionary[tuple[str, str], LoadedWeights] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    def get(self, model_digest: str, device: str) -> LoadedWeights:
        with self._lock:
            weights = self._loaded.get((model_digest, device))
            if weights is None:
                path = self.artifacts.prepared_path(model_digest)
                weights = LoadedWeights(path, device, self.max_transformed_ratio)
                self._loaded[(model_digest, device)] = weights
            return weights

    def find(self, model_digest: str, device: str) -> LoadedWeights | None:
        """A version's weights where some kernel holds them; None (and nothing loaded) elsewhere."""
        with self._lock:
            return self._loaded.get((model_digest, device))

    @property
    def total_bytes(self) -> int:
        with self._lock:
            return sum(weights.nbytes for weights in self._loaded.values())


class Kernels:
    """Kernels bound to a model version's weights: from the cache, else loaded from the store (a reload,
    never a compile)."""

    def __init__(
        self,
        cache: KernelCache,
        artifacts: KernelStore,
        metrics: Metrics,
        open_engine: EngineOpener = open_tvm_engine,
        openvino: OpenVinoBuilds | None = None,
        *,
        max_transformed_ratio: float = 0.0,
    ) -> None:
        """``max_transformed_ratio``: what a version's kernels' transforms may compute from its weights, in
        multiples of their bytes (0: no bound)."""
        self.cache = cache
        self.artifacts = artifacts
        self.metrics = metrics
        self.weights = WeightPool(artifacts, max_transformed_ratio)
        self._open_engine = open_engine
        self.openvino = openvino
        self._rebuilding = threading.Lock()  # one OpenVINO rebuild at a time: requests missing it wait for it

    @staticmethod
    def cache_key(served: ServedModel, key: str) -> CacheKey:
        return key, served.record.digest

    def get(self, served: ServedModel, key: str) -> Engine | None:
        return self.cache.get(self.cache_key(served, key))

    def has(self, served: ServedModel, key: str) -> bool:
        return self.cache_key(served, key) in self.cache

    def open(self, served: ServedModel, key: str) -> Engine:
        """A private instance of a stored kernel with the version's weights, outside the cache (routing
        times these)."""
        return self._open(served, key)[0]

    def load(self, served: ServedModel, key: str) -> Engine:
        if key.startswith(OPENVINO_KEY_PREFIX):
            return self._rebuild_openvino(served, key)
        engine, manifest = self._open(served, key)
        touch(self.artifacts, {key})  # used now: the store's budget removes the longest unused first
        # What the kernel holds: its code and workspace. The weights are the version's, shared by its kernels.
        self.cache.put(self.cache_key(served, key), engine, kernel_memory(manifest))
        self.metrics.kernels.set_entries(entries=len(self.cache))
        return engine

    def _open(self, served: ServedModel, key: str) -> tuple[Engine, Manifest]:
        manifest = self.artifacts.get(key)
        if manifest is None:
            raise CompileError(f"kernel {key[:16]} is no longer in the store")
        weights = self.weights.get(served.model.digest, target_kind(served.target)).for_kernel(manifest)
        library = self.artifacts.library_path(key)
        return self._open_engine(library, served.model.signature, served.target, weights), manifest

    def hold(self, served: ServedModel, key: str, engine: Engine, nbytes: int) -> None:
        """Cache an engine built outside the store (OpenVINO), counting the ``nbytes`` it holds."""
        self.cache.put(self.cache_key(served, key), engine, nbytes)
        self.metrics.kernels.set_entries(entries=len(self.cache))

    def drop(self, served: ServedModel, key: str) -> None:
        self.cache.discard(self.cache_key(served, key))
        self.metrics.kernels.set_entries(entries=len(self.cache))

    def _rebuild_openvino(self, served: ServedModel, key: str) -> Engine:
        """OpenVINO for the bucket routed to it, built and verified again (evicted, or a restart)."""
        with self._rebuilding:
            engine = self.get(served, key)
            if engine is not None:
                return engine
            found = [
                (bucket, facts["precision"])
                for bucket in list(served.buckets.values())
                for facts in (bucket.openvino or {}).values()
                if facts.get("key") == key
            ]
            if self.openvino is None or not found:
                raise CompileError(f"openvino {key[:24]} is not built for any bucket of model {served.name!r}")
            built = self.openvino.build(served, *found[0])
            if built.engine is None:
                raise CompileError(built.failure or "openvino failed to build")
            self.hold(served, key, built.engine, built.engine.nbytes)
            return built.engine

    def describe_weights(self, served: ServedModel) -> dict | None:
        """The version's weights as its kernels hold them: mapped, and transformed (panels, blocked layouts)
        once per layout its kernels read; what its models compiled by OpenVINO hold; None while nothing
        holds them."""
        loaded = self.weights.find(served.model.digest, target_kind(served.target))
        described = loaded.describe() if loaded is not None else {}
        if self.openvino is not None:
            described["openvino_bytes"] = self.openvino.held_bytes(served)
        return described or None

    def loaded_keys(self) -> set[str]:
        """The store keys of the kernels held in memory (whichever versions' weights they run with)."""
        return {key for key, _ in self.cache.cached_keys()}

    def forget(self, served: ServedModel) -> None:
        """A model version retired: its kernels leave the cache, and its weights go with the last one
        (a request still running holds them until it ends)."""
        digest = served.record.digest
        if self.cache.discard_where(lambda cache_key: cache_key[1] == digest):
            self.metrics.kernels.set_entries(entries=len(self.cache))
