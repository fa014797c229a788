"""The inference routes straight from ASGI, past FastAPI's router.

Matching a request against every registered route and solving the handler's
parameters cost more than the rest of a small prediction (measured in-process:
220 us per V2 infer of the demo model, most of it route matching). The same
handlers answer (:mod:`server.routes`, :mod:`server.v2`); FastAPI keeps the
routes for the OpenAPI document. Errors become responses through the one
mapping in :mod:`server.app`.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from .routes import predict_request
from .v2 import infer

HOT_PATH = re.compile(
    r"^/(?:predict|models/(?P<model>[^/]+)/predict"
    r"|v2/models/(?P<v2_model>[^/]+)(?:/versions/(?P<version>[^/]+))?/infer)$"
)


class HotRoutes:
    """ASGI middleware: ``POST`` predictions and V2 infers go to their handlers directly."""

    def __init__(self, app: ASGIApp, error_response: Callable[[Exception], Response]) -> None:
        self.app = app
        self.error_response = error_response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        found = HOT_PATH.match(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if found is None:
            await self.app(scope, receive, send)
            return
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
