"""Each gRPC call adapted to the runtime calls its REST twin makes (:mod:`server.v2`): same buckets,
batching, routing and limits, the same errors as gRPC status codes with the same messages."""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from compiler.errors import BadRequestError, JitServeError, NotFoundError

from ..auth import check_admin
from ..oip import model_metadata, served_version, server_metadata
from ..runtime.models.registry import ServedModel
from ..runtime.observability.metrics import Metrics
from ..runtime.service import ModelService
from ..runtime.serving.inference import PROTOCOL, Prediction
from ..runtime.serving.requests import Lookup
from ..v2_codec import InferRequest
from . import messages as pb
from .codec import decode_request, encode_response, typed_elements

log = logging.getLogger("jitserve")

STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.ALREADY_EXISTS,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    503: grpc.StatusCode.UNAVAILABLE,
    507: grpc.StatusCode.RESOURCE_EXHAUSTED,
}
"""The gRPC status of each HTTP status a :class:`JitServeError` carries; any other is INTERNAL."""


def status_of(exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The one place errors become gRPC statuses, as :func:`server.app.error_response` makes them HTTP."""
    if isinstance(exc, JitServeError):
        return STATUS_CODES.get(exc.http_status, grpc.StatusCode.INTERNAL), str(exc)
    # A server bug: the id ties the client's answer to the traceback in the log.
    request_id = uuid.uuid4().hex[:16]
    log.error("unhandled error in a gRPC call (request id %s)", request_id, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__} (request id {request_id})"


class GrpcInferCodec:
    """The Open Inference Protocol's ``ModelInfer`` message: typed or raw tensor contents, decoded by the
    model's signature; answered the way it asked (raw contents for a raw request)."""

    def __init__(self, request: pb.ModelInferRequest) -> None:
        self.request = request
        self.model = request.model_name
        self.size = request.ByteSize()

    async def read(self, _parsers) -> pb.ModelInferRequest:
        return self.request  # gRPC has read it already

    @staticmethod
    def decode_work(request: pb.ModelInferRequest) -> int:
        # Raw contents cost a copy to decode; typed ones a Python conversion per value (off the loop when many).
        return typed_elements(request) * 8

    @staticmethod
    def decode(request: pb.ModelInferRequest, lookup: Lookup) -> tuple[ServedModel, dict, InferRequest]:
        served = lookup(request.model_name, request.model_version or None)
        decoded = decode_request(request, served.model.signature)
        return served, decoded.inputs, decoded

    def encode(self, prediction: Prediction, decoded: InferRequest) -> pb.ModelInferResponse:
        raw = bool(self.request.raw_input_contents)
        return encode_response(prediction.model, prediction.version, decoded, prediction.outputs, raw=raw)


Call = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[Any]]


def rpc(method: Call) -> Call:
    """A call counted by method and status, its errors answered through :func:`status_of`."""
    name = method.__name__

    @functools.wraps(method)
    async def call(self: InferenceServicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
        PROTOCOL.set("grpc")  # this call's task only: its predictions are counted under grpc
        try:
            if isinstance(request, pb.MalformedMessage):
                raise BadRequestError(f"malformed {request.message}: {request.problem}")
            response = await method(self, request, context)
        except Exception as exc:  # noqa: BLE001 - every error answers through the one mapping
            code, message = status_of(exc)
            self.metrics.serving.record_grpc_call(method=name, code=code.name)
            await context.abort(code, message)
        self.metrics.serving.record_grpc_call(method=name, code="OK")
        return response

    return call


def admin(method: Call) -> Call:
    """A management call: needs ``authorization: Bearer <admin token>`` metadata when a token is set."""

    @functools.wraps(method)
    async def call(self: InferenceServicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
        metadata = dict(context.invocation_metadata() or ())
        check_admin(self.admin_token, metadata.get("authorization", ""))
        return await method(self, request, context)

    return call


class InferenceServicer:
    """One coroutine per method of ``inference.GRPCInferenceService``, named as the method."""

    def __init__(self, service: ModelService, metrics: Metrics, admin_token: str | None) -> None:
        self.service = service
        self.metrics = metrics
        self.admin_token = admin_token

    @rpc
    async def ServerLive(self, request, context) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    @rpc
    async def ServerReady(self, request, context) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.service.ready()[0])

    @rpc
    async def ModelReady(self, request, context) -> pb.ModelReadyResponse:
        """Ready while served (ONNX Runtime serves every model from its upload on); a model or version not
        served is not ready, as Triton answers it (and as tritonclient reads REST's 404)."""
        try:
            served_version(self.service, request.name, request.version or None)
        except NotFoundError:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=True)

    @rpc
    async def ServerMetadata(self, request, context) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(**server_metadata())

    @rpc
    async def ModelMetadata(self, request, context) -> pb.ModelMetadataResponse:
        served = served_version(self.service, request.name, request.version or None)
        return pb.ModelMetadataResponse(**model_metadata(served))

    @rpc
    async def ModelInfer(self, request: pb.ModelInferRequest, context) -> pb.ModelInferResponse:
        response, _ = await self.service.infer(GrpcInferCodec(request))
        return response

    # -- the model repository extension, under the admin token

    @rpc
    @admin
    async def RepositoryIndex(self, request, context) -> pb.RepositoryIndexResponse:
        """Every stored model: READY when served, UNAVAILABLE when unloaded (only the first with ``ready``)."""
        models = await asyncio.to_thread(self.service.repository_index)
        return pb.RepositoryIndexResponse(models=[m for m in models if m["state"] == "READY" or not request.ready])

    @rpc
    @admin
    async def RepositoryModelLoad(self, request, context) -> pb.RepositoryModelLoadResponse:
        """Serve a stored model again (its newest version); RESOURCE_EXHAUSTED when its weights would not fit."""
        await asyncio.to_thread(self.service.load_stored, request.model_name)
        return pb.RepositoryModelLoadResponse()

    @rpc
    @admin
    async def RepositoryModelUnload(self, request, context) -> pb.RepositoryModelUnloadResponse:
        """Stop serving a model and keep it stored (a restart serves it again)."""
        await asyncio.to_thread(self.service.unload, request.model_name)
        return pb.RepositoryModelUnloadResponse()
