"""Inference engines behind one interface: ``run(inputs) -> outputs``."""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np
import onnxruntime as ort
from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument

from ..building.cuda_math import use_exact_cuda_math
from ..errors import BadRequestError, CompileError
from .arrays import contiguous


class Engine(Protocol):
    name: str

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


SPIN_WITHIN_RUNS = "within_runs"
"""``spinning`` that keeps a run's threads spinning between its parallel sections and stops them as it ends."""


def ort_session_options(*, threads: int | None = None, spinning: bool | str = True) -> ort.SessionOptions:
    """ONNX Runtime's session options with ``threads`` intra-op threads (its default where none) that spin
    between runs where ``spinning`` is True, never where False, and only while a run lasts where it is
    :data:`SPIN_WITHIN_RUNS`."""
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    if spinning is False:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    elif spinning == SPIN_WITHIN_RUNS:
        options.add_session_config_entry("session.force_spinning_stop", "1")
    return options


class OrtEngine:
    """ONNX Runtime: always available, the floor every kernel must beat."""

    name = "onnxruntime"

    def __init__(
        self, model_bytes: bytes, *, cuda: bool = False, threads: int | None = None, spinning: bool | str = True
    ) -> None:
        options = ort_session_options(threads=threads, spinning=spinning)
        providers = ["CPUExecutionProvider"]
        if cuda and "CUDAExecutionProvider" in ort.get_available_providers():
            providers.insert(0, ("CUDAExecutionProvider", {"use_tf32": "0"}))  # fp32 answers, not TF32
        self.session = ort.InferenceSession(model_bytes, options, providers=providers)
        # Its Python wrapper keeps the model bytes for a provider fallback on failure, which would hold a
        # second copy of the weights for the session's life: without the fallback it needs none.
        self.session.disable_fallback()
        self.session._model_bytes = None
        self.providers = self.session.get_providers()
        self.output_names = [o.name for o in self.session.get_outputs()]

    def run(self, inputs: dict[str, np.ndarray], run_options: ort.RunOptions | None = None) -> dict[str, np.ndarray]:
        try:
            outputs = self.session.run(None, inputs, run_options)
        except InvalidArgument as exc:  # the input's fault (e.g. an index out of range): a 400, not a 500
            raise BadRequestError(f"onnxruntime refused the input: {_status_message(exc)}") from None
        except Fail as exc:
            # A node that cannot run on these shapes (a detector's levels that disagree for a size that is
            # no multiple of its stride): the model loaded and ran at other shapes, so the input's fault.
            node = re.search(r"running (\w+) node(?:\. Name:'([^']*)')?", str(exc))
            if node is None:
                raise
            named = f" {node[2]!r}" if node[2] else ""
            raise BadRequestError(
                f"onnxruntime cannot run the model on this input's shape ({node[1]} node{named}): "
                f"{_status_message(exc)}"
            ) from None
        return dict(zip(self.output_names, outputs, strict=True))


class ArenaReturningRuns:
    """An :class:`OrtEngine` whose runs give back what they grew its memory arena by as they end: for one-off
    runs at sizes serving may never see (the padding probe's). Left in the arena, BERT-base's probe kept 0.8x
    its weights for the model's life."""

    name = OrtEngine.name

    def __init__(self, engine: OrtEngine) -> None:
        self.engine = engine
        self.output_names = engine.output_names
        self._options = ort.RunOptions()
        self._options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.engine.run(inputs, self._options)


def _status_message(exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    _, found, message = text.partition("Status Message: ")
    message = message if found else text.rpartition(" : ")[2]
    # Without the check's source location and condition: "/src/...h:583 void f(...) x == 1 was false. "
    return re.sub(r"^/\S+:\d+ .*? was false\.\s*", "", message)


def device_weights(arrays: list[np.ndarray], device: str = "llvm") -> list:
    """Weights as TVM tensors: on the CPU the arrays' own memory (DLPack, no copy), on a GPU a copy there."""
    import tvm

    if device == "cuda":
        return [tvm.runtime.tensor(array, tvm.cuda(0)) for array in arrays]
    return [tvm.runtime.from_dlpack(array) for array in arrays]


TRANSFORM_PARAMS = "main_transform_params"
"""A kernel's lifted weight transform (see compiler/tvm/layout.py), split into one function per weight
``main`` takes (``transform_output_name``, compiler/tvm/weight_transform.py): run once, their results are
the weights ``main`` takes."""


def transform_output_name(index: int) -> str:
    return f"{TRANSFORM_PARAMS}_{index}"


class TransformedWeights:
    """What kernels' lifted transforms computed from one model version's weights, once per distinct output
    (its digest in the manifest's ``weight_outputs``): every bucket whose kernel reads a weight in the same
    layout shares one copy of it, and a further bucket computes only what is its own. An output is let go
    of with the last kernel holding it (``release``): a kernel measured slower and dropped (a bf16 one, a
    tuned one that lost) leaves nothing of its own behind. ``computed`` hears of each kernel's transform
    (its input weights, all its results) once its missing outputs are computed."""

    def __init__(self, computed: Callable[[list, list], None] | None = None) -> None:
        self._by_digest: dict[str, object] = {}
        self._bytes: dict[str, int] = {}
        self._holders: dict[str, int] = {}
        self._lock = threading.Lock()
        self._computed = computed

    @property
    def nbytes(self) -> int:
        """What the transforms computed, not the weights they pass through as they are."""
        return sum(self._bytes.values())

    @property
    def count(self) -> int:
        """Distinct outputs computed (not passed through)."""
        return sum(1 for size in self._bytes.values() if size)

    def missing_bytes(self, outputs: list[dict]) -> int:
        """What computing a kernel's transform would add (by its manifest's ``weight_outputs``)."""
        with self._lock:
            missing = {fact["digest"]: fact["bytes"] for fact in outputs if fact["digest"] not in self._by_digest}
            return sum(missing.values())

    def get(self, digests: list[str], compute: Callable[[int], object], weights: list) -> list:
        """Output ``i`` of a kernel's transform, for each of ``digests``: computed by ``compute(i)`` where no
        kernel of the version computed that digest before."""
        with self._lock:  # held while computing: a second bucket waits for the first one's results
            passed = {weight.data_ptr() for weight in weights}
            computed = False
            for i, digest in enumerate(digests):
                if digest not in self._by_digest:
                    result = self._by_digest[digest] = compute(i)
                    self._bytes[digest] = 0 if result.data_ptr() in passed else tensor_bytes(result)
                    computed = True
            results = [self._by_digest[digest] for digest in digests]
            for digest in digests:
                self._holders[digest] = self._holders.get(digest, 0) + 1
            if computed and self._computed is not None:
                self._computed(weights, results)
            return results

    def release(self, digests: list[str]) -> None:
        """A kernel that took ``digests`` (by :meth:`get`) is gone: what no other kernel holds is let go of."""
        with self._lock:
            for digest in digests:
                held = self._holders.get(digest, 0) - 1
                if held > 0:
                    self._holders[digest] = held
                    continue
                for table in (self._holders, self._by_digest, self._bytes):
                    table.pop(digest, None)


def tensor_bytes(tensor) -> int:
    return int(np.prod(tensor.shape, dtype=np.int64)) * np.dtype(str(tensor.dtype)).itemsize


class TvmEngine:
    """A compiled Relax executable loaded from the artifact store, run with its model version's weights
    (TVM tensors or arrays, in the kernel's parameter order) after the inputs. A kernel with a lifted
    weight transform (``weight_outputs``: the manifest's digest and bytes of each output) runs it here, once
    per output the version's ``transformed`` weights lack; they share them with the version's other kernels."""

    name = "tvm"

    def __init__(
        self,
        library: str | Path,
        input_names: list[str],
        output_names: list[str],
        *,
        device: str = "llvm",
        weights: list | None = None,
        transformed: TransformedWeights | None = None,
        weight_outputs: list[dict] | None = None,
    ) -> None:
        # Imported here: processes that never run a kernel need not load TVM.
        import tvm
        from tvm import relax

        self._tvm = tvm
        self._device = tvm.cuda(0) if device == "cuda" else tvm.cpu(0)
        if device == "cuda":
            use_exact_cuda_math()  # a library built without a GPU holds CUDA source, compiled as it loads
        weights = weights or []
        if weights and isinstance(weights[0], np.ndarray):
            weights = device_weights(weights, device)
        self._module = tvm.runtime.load_module(str(library))
        self._vm = relax.VirtualMachine(self._module, self._device)
        self._main = self._vm["main"]
        # Held while this kernel lives, transformed or not: a server's weight pool keeps a version's weights
        # (and what was computed from them) only while some kernel holds them.
        self._prepared = weights
        weights = self._transformed(weights, weight_outputs, transformed)
        self._weights = weights
        self.input_names = input_names
        self.output_names = output_names
        # The VM keeps per-call register state: one call at a time.
        self._lock = threading.Lock()

    def _transformed(self, weights: list, outputs: list[dict] | None, shared: TransformedWeights | None) -> list:
        """The weights ``main`` takes: its lifted transform's outputs where it has one. Shared through
        ``shared`` by the outputs' digests (``outputs``: the manifest's); without them, computed here."""
        from tvm import relax

        count = 0
        while self._vm.module.implements_function(transform_output_name(count)):
            count += 1
        if not count:
            return weights
        if outputs is not None and len(outputs) != count:
            raise CompileError(f"the kernel's weight transform has {count} outputs, its manifest names {len(outputs)}")
        sharing = bool(outputs) and shared is not None
        digests = [fact["digest"] for fact in outputs] if sharing else [str(i) for i in range(count)]
        # Run by a VM of its own with the plain allocator: the pooled one keeps all it ever allocated for
        # later calls, so the transformed weights outlived their model version (a 108 MiB encoder's
        # panels stayed resident after its delete).
        vm = relax.VirtualMachine(self._module, self._device, memory_cfg="naive")
        pool = shared if sharing else TransformedWeights()
        results = pool.get(digests, lambda i: vm[transform_output_name(i)](weights), weights)
        if sharing:
            weakref.finalize(self, pool.release, digests)
        return results

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        tensor = self._tvm.runtime.tensor
        args = [tensor(contiguous(inputs[name]), self._device) for name in self.input_names]
        args.extend(self._weights)
        with self._lock:
            result = self._main(*args)
        results = [result] if isinstance(result, self._tvm.runtime.Tensor) else list(result)
        return {name: value.numpy() for name, value in zip(self.output_names, results, strict=True)}

    def set_instrument(self, instrument) -> None:
        """Call ``instrument`` around every VM call (see :mod:`compiler.measuring.profile`); ``None`` stops it."""
        with self._lock:
            self._vm.set_instrument(instrument if instrument is not None else _no_instrument)


def _no_instrument(*_args) -> int:
    return 0  # VMInstrumentReturnKind.NO_OP
