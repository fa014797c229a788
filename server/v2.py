"""Open Inference Protocol (KServe V2) over REST, next to ``/predict``:
server and model metadata, health, readiness, and infer with JSON or binary
tensors. Thin adapters over the same runtime calls as the rest of the API."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from compiler.errors import JitServeError

from .auth import require_admin
from .body import WireResponse, declared_size, read_limited, server_timing
from .oip import model_metadata as model_metadata_body
from .oip import served_version
from .oip import server_metadata as server_metadata_body
from .routes import service_of
from .runtime.inference import Job
from .runtime.service import ModelService
from .schemas import (
    V2InferRequest,
    V2InferResponse,
    V2Live,
    V2ModelMetadata,
    V2ModelReady,
    V2Ready,
    V2RepositoryModel,
    V2ServerMetadata,
    error_responses,
)
from .v2_codec import HEADER_LENGTH, InferRequest, decode_request, encode_response

router = APIRouter(prefix="/v2", tags=["Open Inference Protocol"])


@router.get("", response_model=V2ServerMetadata)
async def server_metadata() -> dict:
    return server_metadata_body()


@router.get("/health/live", response_model=V2Live)
async def live() -> dict:
    return {"live": True}


@router.get("/health/ready", response_model=V2Ready, responses={503: {"model": V2Ready}})
async def ready(request: Request) -> JSONResponse:
    is_ready, _ = service_of(request).ready()
    return JSONResponse({"ready": is_ready}, status_code=200 if is_ready else 503)


@router.get("/models/{name}", response_model=V2ModelMetadata, responses=error_responses(404))
@router.get("/models/{name}/versions/{version}", response_model=V2ModelMetadata, responses=error_responses(404))
async def model_metadata(name: str, request: Request, version: str | None = None) -> dict:
    return model_metadata_body(served_version(service_of(request), name, version))


@router.get("/models/{name}/ready", response_model=V2ModelReady, responses=error_responses(404))
@router.get("/models/{name}/versions/{version}/ready", response_model=V2ModelReady, responses=error_responses(404))
async def model_ready(name: str, request: Request, version: str | None = None) -> dict:
    served = served_version(service_of(request), name, version)
    return {"name": served.name, "ready": True}  # ONNX Runtime serves every model from its upload on


INFER = {
    "response_model": V2InferResponse,
    "responses": {
        200: {
            "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
            "description": "JSON, or with binary outputs a JSON header of Inference-Header-Content-Length bytes "
            "followed by the raw output tensors",
        },
        **error_responses(400, 404, 413, 500, 503),
    },
    "openapi_extra": {
        "parameters": [
            {
                "name": HEADER_LENGTH,
                "in": "header",
                "required": False,
                "schema": {"type": "integer", "minimum": 0},
                "description": "binary tensor extension: bytes of the JSON header that starts the body",
            }
        ],
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": V2InferRequest.model_json_schema()},
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
            },
        },
    },
}


@router.post("/models/{name}/infer", **INFER)
@router.post("/models/{name}/versions/{version}/infer", **INFER)
async def infer(name: str, request: Request, version: str | None = None) -> Response:
    service = service_of(request)
    limit = request.app.state.settings.max_infer_bytes
    try:
        signature = served_version(service, name, version).model.signature
    except JitServeError as exc:
        service.reject_request(name, exc)
        raise
    async with service.body_room(declared_size(request, limit), name):
        try:
            body = await read_limited(request, limit)
        except JitServeError as exc:
            service.reject_request(name, exc)
            raise
        header = request.headers.get(HEADER_LENGTH)
        # Binary tensors cost nothing to decode (frombuffer): only the JSON part counts.
        json_size = int(header) if header is not None and header.isdigit() else len(body)
        decoded, job = await service.off_loop(json_size, _prepare, service, name, body, header, signature, model=name)
        del body
        prediction = await service.run(job)
        content, content_type, headers = await service.off_loop(
            prediction.nbytes, encode_response, prediction.model, prediction.version, decoded, prediction.outputs
        )
    return WireResponse(content, content_type, [*headers, server_timing(prediction)])


def _prepare(service: ModelService, name: str, body: bytes, header: str | None, signature) -> tuple[InferRequest, Job]:
    """An infer body decoded, parsed and planned; a refusal is counted."""
    try:
        decoded = decode_request(body, header, signature)
        return decoded, service.prepare(name, decoded.inputs)
    except JitServeError as exc:
        service.reject_request(name, exc)
        raise


# -- model repository extension: the stored models, loaded and unloaded under the admin token

REPOSITORY = {"dependencies": [Depends(require_admin)], "responses": error_responses(401, 404)}


@router.post("/repository/index", response_model=list[V2RepositoryModel], **REPOSITORY)
async def repository_index(request: Request) -> list[dict]:
    """Every stored model: ``READY`` when served, ``UNAVAILABLE`` when unloaded."""
    return await run_in_threadpool(service_of(request).repository_index)


@router.post(
    "/repository/models/{name}/load", dependencies=REPOSITORY["dependencies"], responses=error_responses(401, 404, 507)
)
async def repository_load(name: str, request: Request) -> dict:
    """Serve a stored model again (its newest version); nothing to do for one being served; 507 when its
    weights would not fit in memory beside the models served."""
    await run_in_threadpool(service_of(request).load_stored, name)
    return {}


@router.post("/repository/models/{name}/unload", **REPOSITORY)
async def repository_unload(name: str, request: Request) -> dict:
    """Stop serving a model and keep it stored (a restart serves it again)."""
    await run_in_threadpool(service_of(request).unload, name)
    return {}
