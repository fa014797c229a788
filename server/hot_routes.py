"""The inference routes straight from ASGI, before FastAPI's middleware and router.

Matching a request against every registered route, solving the handler's
parameters and passing through FastAPI's middleware (telemetry reads the
environment on every request) cost more than the rest of a small prediction
(measured in-process: 220 us per V2 infer of the demo model with the router,
most of it route matching). The same handlers answer (:mod:`server.routes`,
:mod:`server.v2`); FastAPI keeps the routes for the OpenAPI document. Errors
become responses through the one mapping in :mod:`server.app`.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from .routes import predict_request
from .v2 import infer

HOT_PATH = re.compile(
    r"^/(?:predict|models/(?P<model>[^/]+)/predict"
    r"|v2/models/(?P<v2_model>[^/]+)(?:/versions/(?P<version>[^/]+))?/infer)$"
)


class HotRoutesApp(FastAPI):
    """The FastAPI app, answering ``POST`` predictions and V2 infers before anything else runs."""

    error_response: Callable[[Exception], Response]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        found = HOT_PATH.match(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if found is None:
            await super().__call__(scope, receive, send)
            return
        scope["app"] = self
        request = Request(scope, receive)
        handler: Awaitable[Response]
        if found["v2_model"] is not None:
            handler = infer(found["v2_model"], request, found["version"])
        else:
            handler = predict_request(request, found["model"])
        try:
            response = await handler
        except Exception as exc:  # noqa: BLE001 - every error answers through the one mapping
            response = self.error_response(exc)
        await response(scope, receive, send)
