"""Request bodies read with their size limit enforced while reading; uploads written to disk as they arrive;
prediction responses put on the wire as they are."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from compiler.errors import BadRequestError, PayloadTooLargeError
from compiler.models.upload import UPLOAD_MODEL_NAME, safe_relative_path

from .runtime.serving.inference import Prediction

MAX_DATA_PARTS = 64
UPLOAD_CHUNK = 1 << 20


def refuse_declared_over(request: Request, limit: int) -> None:
    """413 before reading when the body's declared length is over ``limit``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLargeError(f"request body of {declared} bytes is over the limit of {limit}")


async def limited_stream(request: Request, limit: int) -> AsyncIterator[bytes]:
    """The request body chunk by chunk; 413 as soon as it passes ``limit``."""
    refuse_declared_over(request, limit)
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise PayloadTooLargeError(f"request body is over the limit of {limit} bytes")
        yield chunk


def declared_size(request: Request, limit: int) -> int:
    """The body's declared length; the limit for a chunked body (its length is known only once read)."""
    declared = request.headers.get("content-length")
    return int(declared) if declared is not None and declared.isdigit() and int(declared) <= limit else limit


async def read_limited(request: Request, limit: int) -> bytes:
    """The whole body; 413 as soon as it passes ``limit``. Reads ASGI messages directly: an async generator
    per request costs more than parsing a small prediction."""
    refuse_declared_over(request, limit)
    chunks, total = [], 0
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        total += len(chunk)
        if total > limit:
            raise PayloadTooLargeError(f"request body is over the limit of {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def server_timing(prediction: Prediction) -> tuple[bytes, bytes]:
    """The engine's share (pad, run, cut back) of the request, for clients comparing it with routing's timings."""
    return b"server-timing", b"inference;dur=%.3f" % prediction.inference_ms


class WireResponse(Response):
    """A 200 response whose headers are given as they go on the wire: none of Starlette's header
    normalisation on the prediction path."""

    def __init__(self, content: bytes, content_type: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        self.status_code = 200
        self.background = None
        self.body = content
        self.raw_headers = [(b"content-type", content_type), (b"content-length", b"%d" % len(content)), *headers]


async def _write(chunks: AsyncIterator[bytes], path: Path) -> None:
    with open(path, "wb") as handle:
        async for chunk in chunks:
            await run_in_threadpool(handle.write, chunk)


async def _upload_chunks(part: UploadFile) -> AsyncIterator[bytes]:
    while chunk := await part.read(UPLOAD_CHUNK):
        yield chunk


async def receive_upload(request: Request, limit: int, folder: Path) -> dict | None:
    """Write an upload into ``folder`` as it arrives; return its config.

    The body is the ONNX file (or a .zip/.tar of the model folder), or multipart
    with a ``model`` part, an optional ``config`` JSON part and one ``data``
    part per external data file, named as the model names it.
    """
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        await _write(limited_stream(request, limit), folder / UPLOAD_MODEL_NAME)
        return None
    try:
        parser = MultiPartParser(
            request.headers, limited_stream(request, limit), max_files=MAX_DATA_PARTS + 1, max_fields=2
        )
        form = await parser.parse()
    except MultiPartException as exc:
        raise BadRequestError(f"malformed multipart body: {exc.message}") from None
    model_part = form.get("model")
    if model_part is None:
        raise BadRequestError("multipart upload needs a 'model' part with the ONNX file")
    if isinstance(model_part, UploadFile):
        await _write(_upload_chunks(model_part), folder / UPLOAD_MODEL_NAME)
    else:
        (folder / UPLOAD_MODEL_NAME).write_bytes(model_part.encode())
    for part in form.getlist("data"):
        if not isinstance(part, UploadFile) or not part.filename:
            raise BadRequestError("each 'data' part must be a file named as the model names it")
        target = folder / safe_relative_path(part.filename)
        if target == folder / UPLOAD_MODEL_NAME:
            raise BadRequestError(f"a 'data' part may not be named {UPLOAD_MODEL_NAME!r}")
        target.parent.mkdir(parents=True, exist_ok=True)
        await _write(_upload_chunks(part), target)
    config_part = form.get("config")
    if config_part is None:
        return None
    text = await config_part.read() if isinstance(config_part, UploadFile) else config_part.encode()
    try:
        config = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequestError(f"config part is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise BadRequestError("config part must be a JSON object")
    return config


def _to_list(value: Any) -> Any:
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    raise TypeError(f"cannot serialize {type(value).__name__}")


def json_bytes(value: Any) -> bytes:
    """orjson writes contiguous numpy arrays directly; anything else goes through tolist()."""
    return orjson.dumps(value, default=_to_list, option=orjson.OPT_SERIALIZE_NUMPY)
