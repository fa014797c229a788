"""REST endpoints: each one adapts HTTP to one ModelService call."""

from __future__ import annotations

import asyncio
import hmac

from fastapi import APIRouter, Depends, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from compiler.errors import BadRequestError, JitServeError, UnauthorizedError
from compiler.service import ModelService

from .body import json_bytes, parse_json_object, parse_upload, read_limited

router = APIRouter()


def service_of(request: Request) -> ModelService:
    return request.app.state.service


def require_admin(request: Request) -> None:
    token = request.app.state.settings.admin_token
    if not token:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    # The scheme is case-insensitive (RFC 9110, 11.1); the token is compared in constant time.
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), token.encode()):
        raise UnauthorizedError("this call needs 'Authorization: Bearer <admin token>'")


@router.put("/models/{name}", status_code=201, dependencies=[Depends(require_admin)])
async def upload_model(name: str, request: Request, replace: bool = False) -> JSONResponse:
    settings = request.app.state.settings
    body = await read_limited(request, settings.max_model_bytes)
    data, config = await parse_upload(request, body)
    described = await run_in_threadpool(service_of(request).register, name, data, config, replace=replace)
    return JSONResponse(described, status_code=201)


@router.get("/models")
async def list_models(request: Request) -> dict:
    service = service_of(request)
    return {"models": [service.describe(name) for name in service.model_names]}


@router.get("/models/{name}")
async def describe_model(name: str, request: Request) -> dict:
    return service_of(request).describe(name)


@router.delete("/models/{name}", status_code=204, dependencies=[Depends(require_admin)])
async def delete_model(name: str, request: Request) -> Response:
    await run_in_threadpool(service_of(request).delete, name)
    return Response(status_code=204)


async def _predict(request: Request, name: str | None) -> Response:
    service = service_of(request)
    try:
        body = parse_json_object(await read_limited(request, request.app.state.settings.max_predict_bytes))
        if name is None:
            name = body.get("model")
            if not isinstance(name, str):
                raise BadRequestError("missing 'model': the name of the model to run")
        if "inputs" not in body:
            raise BadRequestError("missing 'inputs': an object of input name -> nested list")
        future = service.submit_predict(name, body["inputs"])
    except JitServeError as exc:
        # Rejected before reaching a model; label only registered names (bounded).
        model = name if name in service.model_names else ""
        request.app.state.metrics.record_request(model=model, engine="none", code=exc.http_status)
        raise
    result = await asyncio.wrap_future(future)
    # The engine's share (pad, run, cut back) of the request, for clients comparing it with routing's timings.
    timing = f"inference;dur={result.pop('inference_ms'):.3f}"
    return Response(json_bytes(result), media_type="application/json", headers={"server-timing": timing})


@router.post("/predict")
async def predict(request: Request) -> Response:
    return await _predict(request, None)


@router.post("/models/{name}/predict")
async def predict_model(name: str, request: Request) -> Response:
    return await _predict(request, name)


@router.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    ready, waiting = service_of(request).ready()
    return JSONResponse({"ready": ready, "waiting": waiting}, status_code=200 if ready else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    registry = request.app.state.metrics
    return Response(registry.exposition(), media_type=registry.content_type)
