"""The built-in console (``GET /``) and the server status it shows (``GET /server``)."""

from __future__ import annotations

import functools
from pathlib import Path

import fastapi_offline
from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.openapi.docs import get_redoc_html
from fastapi.responses import HTMLResponse

from .console_page import CONSOLE_HTML
from .routes import service_of
from .runtime.status import server_status

router = APIRouter()


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def console() -> HTMLResponse:
    return HTMLResponse(CONSOLE_HTML)


REDOC_LOGO = "https://cdn.redoc.ly/redoc/logo-mini.svg"


@functools.cache
def _redoc_script() -> bytes:
    """ReDoc's bundle from the installed package, less the one thing it fetches from elsewhere: the logo
    in its sidebar's "API docs by Redocly" link (an empty image instead)."""
    script = (Path(fastapi_offline.__file__).parent / "static" / "redoc.standalone.js").read_bytes()
    return script.replace(REDOC_LOGO.encode(), b"data:,")


@router.get("/redoc", response_class=HTMLResponse, include_in_schema=False)
async def redoc() -> HTMLResponse:
    return get_redoc_html(
        openapi_url="/openapi.json",
        title="jitserve - ReDoc",
        redoc_js_url="/redoc.standalone.js",
        redoc_favicon_url="data:,",
        with_google_fonts=False,
    )


@router.get("/redoc.standalone.js", include_in_schema=False)
async def redoc_script() -> Response:
    return Response(_redoc_script(), media_type="text/javascript")


@router.get("/server")
async def server(request: Request) -> dict:
    """Readiness, the compile queue, the memory of the server and its children, the kernel cache."""
    return await run_in_threadpool(server_status, service_of(request))
