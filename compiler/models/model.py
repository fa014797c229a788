"""Loading and validating uploaded ONNX bytes."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from dataclasses import dataclass, field
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from ..errors import InvalidModelError, PayloadTooLargeError
from .indices import IndexBounds, index_bounds
from .quantized import integer_ops, integer_path_refusal, output_steps
from .signature import Signature, read_signature
from .weights import graph_digest, weight_bytes, weight_data_problem, weightless

# TVM's Relax ONNX importer implements converters from opset 1 onwards but is
# only exercised on modern exports; below 7 the semantics differ too much.
MIN_OPSET = 7


@dataclass(frozen=True)
class LoadedModel:
    """A validated model: the proto, its raw bytes, digest, signature and the ranges of its index inputs.

    A served model lets go of its proto and bytes once they are stored (:meth:`stored_at`): it then
    weighs its signature, and whoever needs the bytes (a compile child) reads them from ``path``."""

    proto: onnx.ModelProto | None
    data: bytes | None
    digest: str
    signature: Signature
    index_bounds: IndexBounds = field(default_factory=IndexBounds)
    graph_digest: str = ""
    """The graph without its weights' values: what kernels are keyed by
    (:func:`compiler.models.weights.graph_digest`)."""
    weight_bytes: int = 0
    opset: int = 0
    path: Path | None = None
    """Where the bytes are stored, once ``data`` is let go."""
    integer_ops: tuple[str, ...] = ()
    """The ops that compute on quantized activations (:mod:`compiler.models.quantized`)."""
    integer_refusal: str | None = None
    """Why the compiled tier would run some of them in float (None where it keeps all of them in integers,
    or there are none): :func:`compiler.models.quantized.integer_path_refusal`."""
    tokenizer: bytes | None = None
    """A ``tokenizer.json`` uploaded beside the model (an archive upload): what generate's text goes through."""
    output_steps: dict[str, float] = field(default_factory=dict)
    """The quantization step of each output dequantized from integers: engines' int8 kernels are verified
    against ONNX Runtime's within one step (:func:`compiler.models.quantized.output_steps`)."""

    def read_bytes(self) -> bytes:
        if self.data is not None:
            return self.data
        if self.path is None:
            raise ValueError("model bytes were let go and are stored nowhere")
        return self.path.read_bytes()

    def stored_at(self, path: Path) -> LoadedModel:
        """This model without its proto and bytes, read from ``path`` when needed."""
        return dataclasses.replace(self, proto=None, data=None, tokenizer=None, path=Path(path))


def model_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _default_opset(model: onnx.ModelProto) -> int:
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return int(entry.version)
    raise InvalidModelError("model imports no default-domain (ai.onnx) opset")


def _iter_node_tensors(nodes):
    """Every TensorProto held by node attributes, subgraphs included."""
    for node in nodes:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            sparse = [attr.sparse_tensor] if attr.HasField("sparse_tensor") else []
            for tensor in [*sparse, *attr.sparse_tensors]:
                yield tensor.values
                yield tensor.indices
            if attr.HasField("g"):
                yield from _iter_tensors(attr.g)
            for subgraph in attr.graphs:
                yield from _iter_tensors(subgraph)


def _iter_tensors(graph: onnx.GraphProto):
    """Every TensorProto of a graph: initializers, attributes, subgraphs."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    yield from _iter_node_tensors(graph.node)


def all_tensors(model: onnx.ModelProto):
    """Every TensorProto of a model: the graph's (subgraphs included) and its local functions'."""
    function_tensors = (t for function in model.functions for t in _iter_node_tensors(function.node))
    return itertools.chain(_iter_tensors(model.graph), function_tensors)


def _reject_external_data(model: onnx.ModelProto) -> None:
    # Model bytes are one file: external data could only point at paths on the
    # server's disk, so any reference left is refused rather than resolved
    # (compiler.models.upload reads the data an upload brings into the model first).
    for tensor in all_tensors(model):
        if tensor.data_location == onnx.TensorProto.EXTERNAL or tensor.external_data:
            location = next((e.value for e in tensor.external_data if e.key == "location"), "?")
            raise InvalidModelError(
                f"tensor {tensor.name!r} references external data ({location!r}); "
                "upload a self-contained model (onnx.save with save_as_external_data=False)"
            )


def load_model(
    data: bytes,
    *,
    max_bytes: int,
    min_opset: int = MIN_OPSET,
    max_opset: int | None = None,
) -> LoadedModel:
    """Parse and validate model bytes; raise a typed error naming the problem."""
    return validate_model(parse_model(data, max_bytes=max_bytes), data, min_opset=min_opset, max_opset=max_opset)


def parse_model(data: bytes, *, max_bytes: int) -> onnx.ModelProto:
    """The proto of model bytes within the size limit, not validated yet."""
    if len(data) > max_bytes:
        raise PayloadTooLargeError(f"model is {len(data)} bytes, over the limit of {max_bytes}")
    if not data:
        raise InvalidModelError("model is empty")
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise InvalidModelError(f"not an ONNX model or truncated: {exc}") from None
    return proto


def validate_model(
    proto: onnx.ModelProto, data: bytes, *, min_opset: int = MIN_OPSET, max_opset: int | None = None
) -> LoadedModel:
    """Validate a parsed model whose serialized bytes are ``data``."""
    try:
        return _validate(proto, data, min_opset, max_opset)
    except UnicodeDecodeError as exc:
        # protobuf parses proto2 strings unchecked: text that is not UTF-8 fails where it is first read
        raise InvalidModelError(f"the model holds a name or text that is not UTF-8: {exc.reason}") from None


def _validate(proto: onnx.ModelProto, data: bytes, min_opset: int, max_opset: int | None) -> LoadedModel:
    if proto.ir_version <= 0 or not proto.HasField("graph") or not proto.graph.node:
        raise InvalidModelError("not an ONNX model: no IR version or empty graph")
    _reject_external_data(proto)
    opset = _default_opset(proto)
    newest = onnx.defs.onnx_opset_version() if max_opset is None else max_opset
    if not min_opset <= opset <= newest:
        raise InvalidModelError(f"opset {opset} is outside the supported range {min_opset}..{newest}")
    light = weightless(proto)  # checked and inferred without copying the weights
    try:
        onnx.checker.check_model(light, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError, ValueError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InvalidModelError(f"onnx checker: {first_line}") from None
    problem = weight_data_problem(proto)
    if problem is not None:
        raise InvalidModelError(f"onnx checker: {problem}")
    return LoadedModel(
        proto,
        data,
        model_digest(data),
        read_signature(proto),
        index_bounds(light),
        graph_digest=graph_digest(proto),
        weight_bytes=weight_bytes(proto),
        opset=opset,
        integer_ops=tuple(integer_ops(proto)),
        integer_refusal=integer_path_refusal(proto),
        output_steps=output_steps(proto),
    )


def load_model_file(path: str, *, max_bytes: int, **kwargs) -> LoadedModel:
    try:
        with open(path, "rb") as handle:
            data = handle.read(max_bytes + 1)
    except OSError as exc:
        raise InvalidModelError(f"cannot read {path}: {exc.strerror}") from None
    return load_model(data, max_bytes=max_bytes, **kwargs)
