"""OpenVINO as an engine beside ONNX Runtime and TVM: Intel's CPU runtime reads the ONNX model itself and
compiles it once per model version and precision, its symbolic dims dynamic, for all its buckets.

It answers in fp32 (``INFERENCE_PRECISION_HINT`` f32): left to its default it runs bf16 on a CPU with
bf16 hardware, whose outputs stray past fp32 verification's tolerance. Like a TVM kernel, it is verified
against ONNX Runtime on the bucket before it may serve (:func:`verify_openvino`), and timed beside the
others. The ``openvino`` package is optional: :func:`openvino_available` says whether it is installed.
"""

from __future__ import annotations

import importlib.util
import shutil
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

from ..errors import BadRequestError, CompileError
from ..models.memory import anonymous_resident_bytes, release_mapped_file_pages
from ..shapes.buckets import Bucket
from .arrays import Comparison, compare_outputs, contiguous, random_inputs
from .engines import OrtEngine


def openvino_available() -> bool:
    return importlib.util.find_spec("openvino") is not None


def openvino_version() -> str:
    import openvino as ov

    return ov.get_version()


def engine_name(precision: str = "f32") -> str:
    """``openvino`` in fp32, ``openvino-bf16`` and the like in a reduced precision."""
    return "openvino" if precision == "f32" else f"openvino-{precision}"


def openvino_capabilities() -> list[str]:
    import openvino as ov

    return list(ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"))


def missing_precision(precision: str) -> str | None:
    """Why this CPU cannot run OpenVINO in ``precision`` (its arithmetic type needs the hardware); None
    where it can."""
    needed = {"bf16": "BF16", "f16": "FP16"}.get(precision)
    capabilities = openvino_capabilities() if needed else []
    if needed is None or needed in capabilities:
        return None
    return f"{precision} needs a CPU with it (AMX or AVX-512 {precision}); this one has {', '.join(capabilities)}"


class OpenVinoModel:
    """A model compiled by OpenVINO once, in ``precision``, for every bucket of it: its symbolic dims left
    dynamic (or fixed to ``shapes``, one bucket's), with the latency hint and ``threads`` inference threads
    (OpenVINO's default where None). Each bucket runs it through an infer request of its own
    (:meth:`engine`), and all of them share its one copy of the weights: compiled per bucket, each held
    another (BERT-base: +0.86x its weights per bucket). ``nbytes``: the process's memory it took to build.

    With an ``ir_dir`` (a fresh path on a disk, not a tmpfs; removed once built), the model goes through
    OpenVINO's own format there:
    OpenVINO then maps the weights from that file instead of copying them, and once it has packed the
    ones it packs, the mapped pages are given back (what it reads as they are, an embedding table, faults
    in again as it is read). Measured on BERT-base (416 MiB of weights): 0.95x the weights resident,
    against 1.85x read from the ONNX bytes, whose weights it keeps beside its packed ones."""

    def __init__(
        self,
        model_bytes: bytes,
        *,
        shapes: dict[str, tuple[int, ...]] | None = None,
        threads: int | None = None,
        ir_dir: Path | None = None,
        precision: str = "f32",
    ) -> None:
        before = anonymous_resident_bytes()
        self.precision = precision
        self.name = engine_name(precision)
        self.compiled = _compile(model_bytes, shapes, threads, ir_dir, precision)
        self.ports = {name: port for port in self.compiled.outputs for name in port.get_names()}
        self.nbytes = max(0, anonymous_resident_bytes() - before)  # the read model (a copy of the weights) gone
        self.grown = 0
        """What its buckets' first runs added, which it keeps: OpenVINO packs some weights anew for a range of
        rows it had not run (the server counts it as each bucket's engine is verified)."""

    def engine(self, shapes: dict[str, tuple[int, ...]], output_names: list[str]) -> OpenVinoEngine:
        return OpenVinoEngine(self, shapes, output_names)


class OpenVinoEngine:
    """One bucket's infer request on a compiled :class:`OpenVinoModel` (which it holds alive). ``nbytes``:
    what the request took beyond the model's."""

    def __init__(self, model: OpenVinoModel, shapes: dict[str, tuple[int, ...]], output_names: list[str]) -> None:
        missing = [name for name in output_names if name not in model.ports]
        if missing:
            raise CompileError(f"openvino's compiled model lacks outputs {missing}")
        before = anonymous_resident_bytes()
        self.model = model
        self.precision = model.precision
        self.name = model.name
        self._request = model.compiled.create_infer_request()
        self._outputs = [(name, model.ports[name]) for name in output_names]
        self.input_names = list(shapes)
        self.shapes = shapes
        self.output_names = output_names
        self.nbytes = max(0, anonymous_resident_bytes() - before)
        self._lock = threading.Lock()  # one infer request: one call at a time

    @classmethod
    def static(
        cls,
        model_bytes: bytes,
        shapes: dict[str, tuple[int, ...]],
        output_names: list[str],
        *,
        threads: int | None = None,
        ir_dir: Path | None = None,
        precision: str = "f32",
    ) -> OpenVinoEngine:
        """The model compiled for one bucket's static shapes alone (the bench's engine); ``nbytes`` counts
        the compiled model's memory too."""
        model = OpenVinoModel(model_bytes, shapes=shapes, threads=threads, ir_dir=ir_dir, precision=precision)
        engine = cls(model, shapes, output_names)
        engine.nbytes += model.nbytes
        return engine

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feed = {name: contiguous(inputs[name]) for name in self.input_names}
        for name, array in feed.items():
            # A dynamic model takes any size: the bucket's request must be its shape, as a static one refuses.
            if tuple(array.shape) != tuple(self.shapes[name]):
                got, bucket = (",".join(str(d) for d in dims) for dims in (array.shape, self.shapes[name]))
                raise BadRequestError(f"openvino refused the input: {name!r} is [{got}], its bucket's [{bucket}]")
        with self._lock:
            try:
                results = self._request.infer(feed)
            except RuntimeError as exc:  # a shape or type the bucket does not take: the request's fault
                raise BadRequestError(f"openvino refused the input: {_reason(exc)}") from None
            # infer copies its outputs out of the request (a later call leaves them as they are): no copy here
            return {name: results[port] for name, port in self._outputs}


def _compile(model_bytes: bytes, shapes: dict[str, tuple[int, ...]] | None, threads: int | None,
             ir_dir: Path | None, precision: str):  # fmt: skip
    import openvino as ov  # optional: only where the engine is enabled and installed

    missing = missing_precision(precision)
    if missing:
        raise CompileError(f"openvino: {missing}")
    if precision == "f16-weights" and ir_dir is None:
        raise CompileError("openvino stores weights in fp16 only through its own format (an ir_dir)")
    core = ov.Core()
    arithmetic = precision if precision in ("bf16", "f16") else "f32"
    config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": arithmetic}
    if threads:
        config["INFERENCE_NUM_THREADS"] = threads
    try:
        model = core.read_model(model=model_bytes)
        if ir_dir is None:
            if shapes is not None:
                model.reshape({name: list(dims) for name, dims in shapes.items()})
            return core.compile_model(model, "CPU", config)
        xml = Path(ir_dir) / "model.xml"
        try:
            xml.parent.mkdir(parents=True)
            ov.save_model(model, str(xml), compress_to_fp16=precision == "f16-weights")
            del model  # its copy of the weights: the one read from the file replaces it
            model = core.read_model(str(xml))
            if shapes is not None:
                model.reshape({name: list(dims) for name, dims in shapes.items()})
            compiled = core.compile_model(model, "CPU", config)
        finally:
            shutil.rmtree(ir_dir, ignore_errors=True)
        # Removed, the file stays mapped (read-only, shared) until the compiled model is dropped.
        release_mapped_file_pages(f"{ir_dir}/")
        return compiled
    except RuntimeError as exc:
        raise CompileError(f"openvino cannot compile the model: {_reason(exc)}") from None


def verify_openvino(
    engine: OpenVinoEngine,
    reference: OrtEngine,
    bucket: Bucket,
    dtypes: dict[str, str],
    *,
    seed: int,
    rtol: float | None = None,
    atol: float | None = None,
    index_limits: dict | None = None,
    steps: dict[str, float] | None = None,
    compare: Callable[[dict, dict], Comparison] | None = None,
) -> tuple[bool, str]:
    """Whether OpenVINO answers as ONNX Runtime does on seeded inputs of the bucket, and the comparison's
    detail: by ``compare`` (the server's, which knows a model's precision contract), else within the
    compile's tolerances (one quantization step on outputs with ``steps``)."""
    inputs = random_inputs(bucket, dtypes, seed, index_limits)
    actual, expected = engine.run(inputs), reference.run(inputs)
    comparison = (compare or partial(compare_outputs, rtol=rtol, atol=atol, steps=steps))(actual, expected)
    return comparison.matches, comparison.detail


def _reason(exc: Exception) -> str:
    """What went wrong in an OpenVINO error, in a line: its messages open with "Exception from src/...cpp:NNN:"
    and the failed check's source, and a conversion failure names the ops it has no rule for further on."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    useful = [line for line in lines if not line.startswith(("Exception from ", "Check '", "To facilitate", "Summary"))]
    return " ".join(useful[:3]) if useful else type(exc).__name__
