"""REST endpoints: each one adapts HTTP to one :class:`ModelService` call."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from compiler.errors import BadRequestError
from compiler.models.upload import remove_upload

from .auth import require_admin
from .body import WireResponse, declared_size, json_bytes, read_limited, receive_upload, server_timing
from .runtime.models.registry import ServedModel
from .runtime.service import ModelService
from .runtime.serving.bodies import JsonParsers
from .runtime.serving.inference import Prediction
from .runtime.serving.requests import Lookup
from .schemas import (
    Health,
    ModelDescription,
    ModelList,
    ModelPredictRequest,
    PredictRequest,
    PredictResponse,
    Readiness,
    error_responses,
)

router = APIRouter()

UPLOAD_BODY = {
    "required": True,
    "content": {
        "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "required": ["model"],
                "properties": {
                    "model": {"type": "string", "format": "binary", "description": "the ONNX file"},
                    "config": {"type": "string", "description": "the model's config as a JSON object"},
                    "data": {
                        "type": "array",
                        "items": {"type": "string", "format": "binary"},
                        "description": "external data files, each named as the model names it",
                    },
                },
            }
        },
    },
}


def json_body(model: type) -> dict:
    return {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}


PREDICT_HEADERS = {"server-timing": {"description": "inference;dur=MS: the engine's share of the request"}}


def service_of(request: Request) -> ModelService:
    return request.app.state.service


@router.put(
    "/models/{name}",
    status_code=201,
    response_model=ModelDescription,
    dependencies=[Depends(require_admin)],
    responses=error_responses(400, 401, 409, 413, 422, 503, 507),
    openapi_extra={"requestBody": UPLOAD_BODY},
)
async def upload_model(name: str, request: Request, replace: bool = False) -> dict:
    """Upload a model: the ONNX file or a .zip/.tar of its folder, or multipart with ``model``, ``config``
    and one ``data`` part per external data file."""
    service = service_of(request)
    folder = service.new_upload_folder()
    try:
        config = await receive_upload(request, request.app.state.settings.max_model_bytes, folder)
        return await run_in_threadpool(service.register_upload, name, folder, config, replace=replace)
    finally:
        await run_in_threadpool(remove_upload, folder)


@router.get("/models", response_model=ModelList)
async def list_models(request: Request) -> dict:
    service = service_of(request)
    return {"models": [service.describe(name) for name in service.model_names]}


@router.get("/models/{name}", response_model=ModelDescription, responses=error_responses(404))
async def describe_model(name: str, request: Request) -> dict:
    return service_of(request).describe(name)


@router.delete(
    "/models/{name}",
    status_code=204,
    response_class=Response,
    dependencies=[Depends(require_admin)],
    responses=error_responses(400, 401, 404),
)
async def delete_model(name: str, request: Request) -> Response:
    await run_in_threadpool(service_of(request).delete, name)
    return Response(status_code=204)


class PredictCodec:
    """``/predict``'s JSON: ``{"model": NAME, "inputs": {INPUT: nested list}}`` (``/models/{name}/predict``:
    the model in the URL), answered ``{"model", "version", "outputs", "engine", "bucket"}``."""

    def __init__(self, request: Request, model: str | None) -> None:
        self.request = request
        self.model = model
        self.limit = request.app.state.settings.max_predict_bytes
        self.size = declared_size(request, self.limit)

    async def read(self, parsers: JsonParsers) -> tuple[int, dict]:
        body = await read_limited(self.request, self.limit)
        return len(body), await parsers.parse(body)

    @staticmethod
    def decode_work(body: tuple[int, dict]) -> int:
        return body[0]

    def decode(self, body: tuple[int, dict], lookup: Lookup) -> tuple[ServedModel, Any, None]:
        parsed = body[1]
        if self.model is None:
            named = parsed.get("model")
            if not isinstance(named, str):
                raise BadRequestError("missing 'model': the name of the model to run")
            self.model = named
        if "inputs" not in parsed:
            raise BadRequestError("missing 'inputs': an object of input name -> nested list")
        return lookup(self.model, None), parsed["inputs"], None

    @staticmethod
    def encode(prediction: Prediction, _context: None) -> bytes:
        return json_bytes(prediction.body())


async def predict_request(request: Request, name: str | None) -> Response:
    content, prediction = await service_of(request).infer(PredictCodec(request, name))
    return WireResponse(content, b"application/json", [server_timing(prediction)])


PREDICT_ROUTE = {
    "response_model": PredictResponse,
    "responses": {200: {"headers": PREDICT_HEADERS}, **error_responses(400, 404, 413, 500, 503)},
}


@router.post("/predict", **PREDICT_ROUTE, openapi_extra={"requestBody": json_body(PredictRequest)})
async def predict(request: Request) -> Response:
    """Run a model: ``{"model": NAME, "inputs": {INPUT: nested list}}``."""
    return await predict_request(request, None)


@router.post("/models/{name}/predict", **PREDICT_ROUTE, openapi_extra={"requestBody": json_body(ModelPredictRequest)})
async def predict_model(name: str, request: Request) -> Response:
    """Run the model ``name``: ``{"inputs": {INPUT: nested list}}``."""
    return await predict_request(request, name)


@router.get("/healthz", response_model=Health)
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
async def readyz(request: Request) -> JSONResponse:
    ready, waiting = service_of(request).ready()
    return JSONResponse({"ready": ready, "waiting": waiting}, status_code=200 if ready else 503)


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus text"}},
)
async def metrics(request: Request) -> Response:
    registry = request.app.state.metrics
    return Response(registry.exposition(), media_type=registry.content_type)
