"""Open Inference Protocol (KServe V2) over REST, next to ``/predict``:
server and model metadata, health, readiness, and infer with JSON or binary
tensors. Thin adapters over the same runtime calls as the rest of the API."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from .auth import require_admin
from .body import WireResponse, declared_size, read_limited, server_timing
from .oip import model_metadata as model_metadata_body
from .oip import served_version
from .oip import server_metadata as server_metadata_body
from .routes import service_of
from .runtime.models.registry import ServedModel
from .runtime.serving.inference import Prediction
from .runtime.serving.requests import Lookup
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


class V2InferCodec:
    """The Open Inference Protocol's infer body over REST: JSON tensors, or a JSON header followed by binary
    tensors (the binary tensor data extension), decoded by the model's signature; answered alike."""

    def __init__(self, request: Request, model: str, version: str | None) -> None:
        self.request = request
        self.model = model
        self.version = version
        self.limit = request.app.state.settings.max_infer_bytes
        self.size = declared_size(request, self.limit)
        self.header = request.headers.get(HEADER_LENGTH)

    async def read(self, _parsers) -> bytes:
        return await read_limited(self.request, self.limit)

    def decode_work(self, body: bytes) -> int:
        # Binary tensors cost nothing to decode (frombuffer): only the JSON part counts.
        header = self.header
        return int(header) if header is not None and header.isdigit() else len(body)

    def decode(self, body: bytes, lookup: Lookup) -> tuple[ServedModel, dict, InferRequest]:
        served = lookup(self.model, self.version)
        decoded = decode_request(body, self.header, served.model.signature)
        return served, decoded.inputs, decoded

    @staticmethod
    def encode(prediction: Prediction, decoded: InferRequest) -> tuple[bytes, bytes, list]:
        return encode_response(prediction.model, prediction.version, decoded, prediction.outputs)


@router.post("/models/{name}/infer", **INFER)
@router.post("/models/{name}/versions/{version}/infer", **INFER)
async def infer(name: str, request: Request, version: str | None = None) -> Response:
    (content, content_type, headers), prediction = await service_of(request).infer(V2InferCodec(request, name, version))
    return WireResponse(content, content_type, [*headers, server_timing(prediction)])


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
