"""Request bodies read with their size limit enforced while reading."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import orjson
from fastapi import Request
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from compiler.errors import BadRequestError, PayloadTooLargeError


async def read_limited(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLargeError(f"request body of {declared} bytes is over the limit of {limit}")
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise PayloadTooLargeError(f"request body is over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json_object(body: bytes) -> dict[str, Any]:
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequestError(f"malformed JSON: {exc}") from None
    if not isinstance(value, dict):
        raise BadRequestError("the JSON body must be an object")
    return value


async def parse_upload(request: Request, body: bytes) -> tuple[bytes, dict | None]:
    """An upload is the raw ONNX file, or multipart with ``model`` and optional ``config``."""
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        return body, None

    async def replay():
        yield body

    try:
        form = await MultiPartParser(request.headers, replay(), max_files=2, max_fields=2).parse()
    except MultiPartException as exc:
        raise BadRequestError(f"malformed multipart body: {exc.message}") from None
    model_part = form.get("model")
    if model_part is None:
        raise BadRequestError("multipart upload needs a 'model' part with the ONNX file")
    model = await model_part.read() if isinstance(model_part, UploadFile) else model_part.encode()
    config_part = form.get("config")
    if config_part is None:
        return model, None
    text = await config_part.read() if isinstance(config_part, UploadFile) else config_part.encode()
    try:
        config = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequestError(f"config part is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise BadRequestError("config part must be a JSON object")
    return model, config


def _to_list(value: Any) -> Any:
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    raise TypeError(f"cannot serialize {type(value).__name__}")


def json_bytes(value: Any) -> bytes:
    """orjson writes contiguous numpy arrays directly; anything else goes through tolist()."""
    return orjson.dumps(value, default=_to_list, option=orjson.OPT_SERIALIZE_NUMPY)
