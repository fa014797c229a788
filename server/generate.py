"""Triton's generate extension over the runtime's generation loops: ``POST /v2/models/{name}/generate``
answers the whole sequence, ``/generate_stream`` one server-sent event per token. A stream whose client
goes away cancels its sequence, which leaves the batch and frees its cache at the next step."""

from __future__ import annotations

import asyncio
import json
import queue

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from compiler.errors import JitServeError

from .routes import service_of
from .runtime.generation.generator import DONE, ERROR, TOKEN, Sequence
from .runtime.generation.text import Text
from .schemas import GenerateRequest, GenerateResponse, error_responses, json_error_responses

router = APIRouter(prefix="/v2", tags=["Generate"])

POLL_SECONDS = 0.05
"""How often a waiting request looks at its sequence's events and its client's connection."""


async def _events(sequence: Sequence, request: Request):
    """The sequence's events as they come; cancels it where the client disconnects first."""
    try:
        while True:
            try:
                kind, value = sequence.events.get_nowait()
            except queue.Empty:
                if await request.is_disconnected():
                    sequence.cancel()
                    return
                await asyncio.sleep(POLL_SECONDS)
                continue
            yield kind, value
            if kind in (DONE, ERROR):
                return
    finally:
        if sequence.finish_reason is None:
            sequence.cancel()


async def _started(request: Request, name: str, body: GenerateRequest) -> tuple[Sequence, Text | None, str]:
    """The request's sequence and the model's tokenizer, submitted from a worker thread: it takes locks, asks
    memory admission, and a model's first one starts its loop."""
    service = service_of(request)
    sequence, text = await run_in_threadpool(service.generate, name, body.input_ids, body.text_input, body.parameters)
    return sequence, text, str(service.get(name).record.version)


@router.post("/models/{name}/generate", response_model=GenerateResponse, responses=error_responses(400, 404, 500, 503))
async def generate(name: str, body: GenerateRequest, request: Request) -> dict:
    """The whole generated sequence, once it ends."""
    sequence, text, version = await _started(request, name, body)
    tokens, finish_reason = [], None
    async for kind, value in _events(sequence, request):
        if kind == TOKEN:
            tokens.append(value)
        elif kind == DONE:
            finish_reason = value
        else:
            raise JitServeError(f"generation failed: {value}")
    answer = {"model_name": name, "model_version": version, "output_ids": tokens, "finish_reason": finish_reason}
    return answer | ({"text_output": text.decode(tokens)} if text else {})


class EventStream(StreamingResponse):
    media_type = "text/event-stream"


STREAM = {
    200: {
        "description": "one server-sent event per token, then one with the finish_reason",
        "content": {"text/event-stream": {"schema": {"type": "string", "example": 'data: {"output_ids": [42]}'}}},
    }
}


@router.post(
    "/models/{name}/generate_stream",
    response_class=EventStream,
    responses={**STREAM, **json_error_responses(400, 404, 503)},
)
async def generate_stream(name: str, body: GenerateRequest, request: Request) -> EventStream:
    """One server-sent event per token (``{"output_ids": [id], "index": n}``), then one with the
    ``finish_reason``; an ``{"error": ...}`` event where the step failed."""
    sequence, text, version = await _started(request, name, body)

    async def stream():
        tokens: list[int] = []
        decoded = ""
        async for kind, value in _events(sequence, request):
            if kind == TOKEN:
                event = {"model_name": name, "model_version": version, "output_ids": [value], "index": len(tokens)}
                tokens.append(value)
                if text:
                    event["text_output"], decoded = text.piece(tokens, decoded)
            elif kind == DONE:
                event = {"model_name": name, "model_version": version, "output_ids": [], "finish_reason": value}
            else:
                event = {"error": f"generation failed: {value}"}
            yield f"data: {json.dumps(event)}\n\n"

    return EventStream(stream())
