"""Open Inference Protocol (KServe V2) tensors: request bodies to numpy
arrays, predictions to response bodies, JSON or with the binary tensor data
extension (``Inference-Header-Content-Length``: a JSON header, then the raw
tensors back to back). Binary tensors become arrays with ``frombuffer`` and go
out as bytes: no Python per element."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from compiler.errors import BadRequestError
from compiler.models.signature import Signature

HEADER_LENGTH = "inference-header-content-length"
DATATYPES = {
    "bool": "BOOL",
    "int8": "INT8",
    "int16": "INT16",
    "int32": "INT32",
    "int64": "INT64",
    "uint8": "UINT8",
    "uint16": "UINT16",
    "uint32": "UINT32",
    "uint64": "UINT64",
    "float16": "FP16",
    "float32": "FP32",
    "float64": "FP64",
}
NUMPY_TYPES = {v2: np.dtype(name) for name, v2 in DATATYPES.items()}
_BY_DTYPE = {dtype: v2 for v2, dtype in NUMPY_TYPES.items()}


def v2_datatype(dtype: str | np.dtype) -> str:
    return _BY_DTYPE[np.dtype(dtype)]


@dataclass
class InferRequest:
    id: str | None
    inputs: dict[str, np.ndarray]
    outputs: list[str] | None = None
    """The outputs asked for, in order; None: all."""
    binary_outputs: set[str] = field(default_factory=set)


def _parameters(entry: dict, where: str) -> dict:
    parameters = entry.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise BadRequestError(f"{where}: 'parameters' must be an object")
    return parameters


def _shape(entry: dict, where: str) -> tuple[int, ...]:
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise BadRequestError(f"{where}: 'shape' must be a list of non-negative integers")
    return tuple(shape)


def input_dtype(name: str, datatype: object, expected: dict[str, str], given: dict[str, Any]) -> np.dtype:
    """The array type of an input the request names with ``datatype``: 400 when the model has no such input,
    it is in ``given`` already, or the datatype is not the model's."""
    if name not in expected:
        raise BadRequestError(f"unknown input {name!r}; the model takes {list(expected)}")
    if name in given:
        raise BadRequestError(f"input {name!r} is given twice")
    want = v2_datatype(expected[name])
    if datatype != want:
        raise BadRequestError(f"input {name!r} has datatype {datatype!r}; the model takes {want}")
    return NUMPY_TYPES[want]


def decode_request(body: bytes, header_length: str | None, signature: Signature) -> InferRequest:
    """A V2 infer body -> arrays of the declared datatypes and shapes; 400 naming what is wrong."""
    if header_length is None:
        head, binary = body, b""
    else:
        if not header_length.isdigit() or int(header_length) > len(body):
            raise BadRequestError(f"Inference-Header-Content-Length {header_length!r} does not fit the body")
        head, binary = body[: int(header_length)], memoryview(body)[int(header_length) :]  # no copy
    try:
        request = orjson.loads(head)
    except orjson.JSONDecodeError as exc:
        raise BadRequestError(f"malformed JSON: {exc}") from None
    if not isinstance(request, dict) or not isinstance(request.get("inputs"), list):
        raise BadRequestError("the infer request must be an object with an 'inputs' list")
    request_id = request.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise BadRequestError("'id' must be a string")
    expected = {spec.name: spec.dtype for spec in signature.inputs}
    arrays, offset = {}, 0
    for index, entry in enumerate(request["inputs"]):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise BadRequestError(f"inputs[{index}] must be an object with a 'name'")
        name, datatype = entry["name"], entry.get("datatype")
        where = f"input {name!r}"
        dtype, shape = input_dtype(name, datatype, expected, arrays), _shape(entry, where)
        count = math.prod(shape)
        size = _parameters(entry, where).get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or size != count * dtype.itemsize:
                raise BadRequestError(
                    f"{where}: binary_data_size {size!r} is not the {count * dtype.itemsize} bytes "
                    f"of a {datatype} tensor of shape {list(shape)}"
                )
            if offset + size > len(binary):
                raise BadRequestError(f"{where}: the body ends before its {size} bytes of binary data")
            array = np.frombuffer(binary, dtype=dtype, count=count, offset=offset).reshape(shape)
            offset += size
        else:
            data = entry.get("data")
            if data is None:
                raise BadRequestError(f"{where} has neither 'data' nor a binary_data_size")
            try:
                array = np.asarray(data, dtype=dtype)
            except (ValueError, TypeError, OverflowError):
                raise BadRequestError(f"{where}: 'data' is not a list of {datatype} values") from None
            if array.size != count:
                raise BadRequestError(f"{where}: 'data' has {array.size} values, shape {list(shape)} needs {count}")
            array = array.reshape(shape)
        arrays[name] = array
    if offset != len(binary):
        raise BadRequestError(f"the body has {len(binary) - offset} bytes of binary data no input claims")
    return InferRequest(request_id, arrays, *_requested_outputs(request, signature))


def _requested_outputs(request: dict, signature: Signature) -> tuple[list[str] | None, set[str]]:
    default_binary = bool(_parameters(request, "request").get("binary_data_output", False))
    entries = request.get("outputs")
    if entries is None:
        return None, set(signature.output_names) if default_binary else set()
    if not isinstance(entries, list):
        raise BadRequestError("'outputs' must be a list")
    names, binary = [], set()
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict) or entry.get("name") not in signature.output_names:
            raise BadRequestError(f"outputs[{index}] must name one of the model's outputs {signature.output_names}")
        names.append(entry["name"])
        if _parameters(entry, f"output {entry['name']!r}").get("binary_data", default_binary):
            binary.add(entry["name"])
    return names, binary


def encode_response(
    model: str, version: int, request: InferRequest, outputs: dict[str, np.ndarray]
) -> tuple[bytes, bytes, list[tuple[bytes, bytes]]]:
    """The response body, its content type and its other headers, as they go on the wire: JSON, or a JSON
    header followed by the binary outputs."""
    tensors, chunks = [], []
    for name in request.outputs or list(outputs):
        array = outputs[name]
        tensor: dict[str, Any] = {"name": name, "datatype": v2_datatype(array.dtype), "shape": list(array.shape)}
        if name in request.binary_outputs:
            raw = np.ascontiguousarray(array).tobytes()
            tensor["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            tensor["data"] = array.reshape(-1)
        tensors.append(tensor)
    response: dict[str, Any] = {"model_name": model, "model_version": str(version), "outputs": tensors}
    if request.id is not None:
        response["id"] = request.id
    head = orjson.dumps(response, option=orjson.OPT_SERIALIZE_NUMPY, default=_to_list)
    if not chunks:
        return head, b"application/json", []
    return head + b"".join(chunks), b"application/octet-stream", [(HEADER_LENGTH.encode(), b"%d" % len(head))]


def _to_list(value: Any) -> Any:
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    raise TypeError(f"cannot serialize {type(value).__name__}")
