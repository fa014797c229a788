"""The app factory: everything built from one Settings object, no globals."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import compile_path

from compiler.errors import JitServeError
from compiler.models.demo import DEMO_CONFIG, DEMO_NAME, demo_model_bytes

from .auth import check_exposure
from .console import DOCS_ASSETS_URL, docs_assets
from .console import router as console_router
from .explain_routes import router as explain_router
from .generate import router as generate_router
from .grpc_api.front_door import GrpcFrontDoor
from .hot_routes import HotRoutesApp
from .openapi import finish_openapi
from .routes import router
from .runtime.observability.metrics import Metrics
from .runtime.service import ModelService
from .runtime.wiring import build_runtime
from .settings import Settings
from .v2 import router as v2_router

log = logging.getLogger("jitserve")


def create_app(
    settings: Settings | None = None,
    *,
    service_factory: Callable[[Settings, Metrics], ModelService] = build_runtime,
) -> FastAPI:
    """The app over a runtime built by ``service_factory`` (tests give it a fake compiler)."""
    settings = settings or Settings()
    check_exposure(settings)
    metrics = Metrics()
    service = service_factory(settings, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.start()
        if settings.demo_model and not service.model_names:
            service.register_default(DEMO_NAME, demo_model_bytes(), DEMO_CONFIG)
            log.info("registered the built-in %r model", DEMO_NAME)
        grpc = app.state.grpc = GrpcFrontDoor(settings, service, metrics) if settings.grpc_port else None
        if grpc is not None:
            await grpc.start()
        yield
        if grpc is not None:
            await grpc.stop()  # begun with the HTTP server's shutdown (server.__main__); the calls in flight end
        service.close()

    app = HotRoutesApp(title="jitserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.error_response = error_response
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.service = service
    app.include_router(router)
    app.include_router(explain_router)
    app.include_router(console_router)
    app.mount(DOCS_ASSETS_URL, docs_assets(), name="docs-assets")
    app.include_router(v2_router)
    app.include_router(generate_router)
    finish_openapi(app)

    async def handle(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, HTTPException) and exc.status_code == 405:
            # Starlette names only the first route matching the path; RFC 9110 wants every method it has.
            exc.headers = {"Allow": ", ".join(allowed_methods(app, request))}
        return error_response(exc)

    for kind in (JitServeError, RequestValidationError, HTTPException, Exception):
        app.add_exception_handler(kind, handle)
    return app


def allowed_methods(app: FastAPI, request: Request) -> list[str]:
    """The methods the OpenAPI document gives the request's path."""
    methods: set[str] = set()
    for template, operations in app.openapi()["paths"].items():
        if compile_path(template)[0].match(request.url.path):
            methods |= {method.upper() for method in operations}
    return sorted(methods)


def error_response(exc: Exception) -> JSONResponse:
    """The one place errors become HTTP: always ``{"error": "..."}``."""
    if isinstance(exc, JitServeError):
        headers = {"WWW-Authenticate": "Bearer"} if exc.http_status == 401 else None
        return JSONResponse({"error": str(exc)}, status_code=exc.http_status, headers=headers)
    if isinstance(exc, RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(p) for p in first["loc"])
        return JSONResponse({"error": f"{where}: {first['msg']}"}, status_code=400)
    if isinstance(exc, ClientDisconnect):
        # The client's choice, not a fault here: nobody reads this answer, and no error is counted.
        log.info("client disconnected before its request body was read whole")
        return JSONResponse({"error": "client disconnected before sending its whole body"}, status_code=400)
    if isinstance(exc, HTTPException):
        # e.g. a 405's Allow header
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code, headers=exc.headers)
    # A server bug: the id ties the client's answer to the traceback in the log.
    request_id = uuid.uuid4().hex[:16]
    log.error("unhandled error (request id %s)", request_id, exc_info=exc)
    return JSONResponse(
        {"error": f"internal error: {type(exc).__name__} (request id {request_id})"},
        status_code=500,
        headers={"X-Request-Id": request_id},
    )
