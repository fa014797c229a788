"""Open Inference Protocol tensors over gRPC: a ``ModelInferRequest`` to numpy arrays, a prediction to a
``ModelInferResponse``. Raw contents become arrays with ``frombuffer`` and go out as bytes (no Python per
element); typed contents are converted per element, in a thread when large. The checks and messages are
the REST side's (:mod:`server.v2_codec`) wherever the two protocols say the same thing."""

from __future__ import annotations

import math

import numpy as np

from compiler.errors import BadRequestError
from compiler.models.signature import Signature

from ..v2_codec import InferRequest, input_dtype, v2_datatype
from . import messages as pb

TYPED_FIELDS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}
"""The ``InferTensorContents`` field of each datatype; FP16 has none (raw contents only)."""
FIELD_TYPES = {
    "bool_contents": np.dtype(bool),
    "int_contents": np.dtype(np.int32),
    "int64_contents": np.dtype(np.int64),
    "uint_contents": np.dtype(np.uint32),
    "uint64_contents": np.dtype(np.uint64),
    "fp32_contents": np.dtype(np.float32),
    "fp64_contents": np.dtype(np.float64),
}


def typed_elements(request: pb.ModelInferRequest) -> int:
    """Values the request sends as typed contents: the work of converting it."""
    return sum(len(getattr(t.contents, TYPED_FIELDS.get(t.datatype, "bytes_contents"))) for t in request.inputs)


def decode_request(request: pb.ModelInferRequest, signature: Signature) -> InferRequest:
    """The request's inputs as arrays of the declared datatypes and shapes; 400 naming what is wrong."""
    expected = {spec.name: spec.dtype for spec in signature.inputs}
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise BadRequestError(f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs")
    arrays: dict[str, np.ndarray] = {}
    for index, tensor in enumerate(request.inputs):
        where = f"input {tensor.name!r}"
        dtype = input_dtype(tensor.name, tensor.datatype, expected, arrays)
        shape = tuple(tensor.shape)
        if any(d < 0 for d in shape):
            raise BadRequestError(f"{where}: 'shape' must be a list of non-negative integers")
        count = math.prod(shape)
        if raw:
            if tensor.HasField("contents"):
                raise BadRequestError(f"{where} has contents although the request sends raw_input_contents")
            if len(raw[index]) != count * dtype.itemsize:
                raise BadRequestError(
                    f"{where}: raw_input_contents[{index}] has {len(raw[index])} bytes, not the "
                    f"{count * dtype.itemsize} bytes of a {tensor.datatype} tensor of shape {list(shape)}"
                )
            arrays[tensor.name] = np.frombuffer(raw[index], dtype=dtype).reshape(shape)
        else:
            arrays[tensor.name] = _typed(tensor, dtype, shape, count, where)
    return InferRequest(request.id or None, arrays, *_requested_outputs(request, signature))


def _typed(tensor, dtype: np.dtype, shape: tuple[int, ...], count: int, where: str) -> np.ndarray:
    field = TYPED_FIELDS.get(tensor.datatype)
    if field is None:
        raise BadRequestError(f"{where}: {tensor.datatype} tensors travel as raw_input_contents only")
    others = [f.name for f, _ in tensor.contents.ListFields() if f.name != field]
    if others:
        raise BadRequestError(f"{where}: a {tensor.datatype} tensor's values go in contents.{field}, not {others[0]}")
    values = getattr(tensor.contents, field)
    if len(values) != count:
        raise BadRequestError(f"{where}: contents.{field} has {len(values)} values, shape {list(shape)} needs {count}")
    wide = np.array(values, dtype=FIELD_TYPES[field])
    if wide.dtype.itemsize > dtype.itemsize and wide.size:  # INT8, INT16, UINT8, UINT16 travel as 32 bits
        low, high = np.iinfo(dtype).min, np.iinfo(dtype).max
        if wide.min() < low or wide.max() > high:
            raise BadRequestError(f"{where}: values outside [{low}, {high}] for {tensor.datatype}")
    return wide.astype(dtype, copy=False).reshape(shape)


def _requested_outputs(request: pb.ModelInferRequest, signature: Signature) -> tuple[list[str] | None, set[str]]:
    names = []
    for index, output in enumerate(request.outputs):
        if output.name not in signature.output_names:
            raise BadRequestError(f"outputs[{index}] must name one of the model's outputs {signature.output_names}")
        names.append(output.name)
    return names or None, set()


def encode_response(
    model: str, version: int, request: InferRequest, outputs: dict[str, np.ndarray], *, raw: bool
) -> pb.ModelInferResponse:
    """The outputs asked for, as raw contents when ``raw`` (or when one has no typed field), else typed."""
    names = request.outputs or list(outputs)
    raw = raw or any(v2_datatype(outputs[name].dtype) not in TYPED_FIELDS for name in names)
    response = pb.ModelInferResponse(model_name=model, model_version=str(version), id=request.id or "")
    for name in names:
        array = outputs[name]
        datatype = v2_datatype(array.dtype)
        tensor = response.outputs.add(name=name, datatype=datatype, shape=array.shape)
        if raw:
            response.raw_output_contents.append(np.ascontiguousarray(array).tobytes())
        else:
            getattr(tensor.contents, TYPED_FIELDS[datatype]).extend(array.reshape(-1).tolist())
    return response
