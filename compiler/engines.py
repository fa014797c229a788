"""Inference engines behind one interface: ``run(inputs) -> outputs``."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Protocol

import numpy as np
import onnxruntime as ort
from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument

from .arrays import contiguous
from .errors import BadRequestError


class Engine(Protocol):
    name: str

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


class OrtEngine:
    """ONNX Runtime: always available, the floor every kernel must beat."""

    name = "onnxruntime"

    def __init__(
        self, model_bytes: bytes, *, cuda: bool = False, threads: int | None = None, spinning: bool = True
    ) -> None:
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        if not spinning:
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        providers = ["CPUExecutionProvider"]
        if cuda and "CUDAExecutionProvider" in ort.get_available_providers():
            providers.insert(0, "CUDAExecutionProvider")
        self.session = ort.InferenceSession(model_bytes, options, providers=providers)
        self.providers = self.session.get_providers()
        self.output_names = [o.name for o in self.session.get_outputs()]

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            outputs = self.session.run(None, inputs)
        except InvalidArgument as exc:  # the input's fault (e.g. an index out of range): a 400, not a 500
            raise BadRequestError(f"onnxruntime refused the input: {_status_message(exc)}") from None
        return dict(zip(self.output_names, outputs, strict=True))


def _status_message(exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    _, found, message = text.partition("Status Message: ")
    return message if found else text.rpartition(" : ")[2]


class TvmEngine:
    """A compiled Relax executable loaded from the artifact store."""

    name = "tvm"

    def __init__(
        self, library: str | Path, input_names: list[str], output_names: list[str], *, device: str = "llvm"
    ) -> None:
        # Imported here: processes that never run a kernel need not load TVM.
        import tvm
        from tvm import relax

        self._tvm = tvm
        self._device = tvm.cuda(0) if device == "cuda" else tvm.cpu(0)
        self._module = tvm.runtime.load_module(str(library))
        self._vm = relax.VirtualMachine(self._module, self._device)
        self._main = self._vm["main"]
        self.input_names = input_names
        self.output_names = output_names
        # The VM keeps per-call register state: one call at a time.
        self._lock = threading.Lock()

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        tensor = self._tvm.runtime.tensor
        args = [tensor(contiguous(inputs[name]), self._device) for name in self.input_names]
        with self._lock:
            result = self._main(*args)
        results = [result] if isinstance(result, self._tvm.runtime.Tensor) else list(result)
        return {name: value.numpy() for name, value in zip(self.output_names, results, strict=True)}
