"""The built-in console (``GET /``) and the server status it shows (``GET /server``)."""

from __future__ import annotations

import functools
from pathlib import Path

import fastapi_offline
from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from .console_page import CONSOLE_HTML
from .routes import service_of
from .runtime.observability.status import server_status

router = APIRouter()


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def console() -> HTMLResponse:
    return HTMLResponse(CONSOLE_HTML)


REDOC_LOGO = "https://cdn.redoc.ly/redoc/logo-mini.svg"
DOCS_ASSETS = Path(fastapi_offline.__file__).parent / "static"
"""Swagger UI's and ReDoc's bundles, from the installed package: /docs and /redoc work offline."""
DOCS_ASSETS_URL = "/static-offline-docs"


def docs_assets() -> StaticFiles:
    """What the app mounts at ``DOCS_ASSETS_URL``."""
    return StaticFiles(directory=DOCS_ASSETS)


@router.get("/docs", response_class=HTMLResponse, include_in_schema=False)
async def swagger_ui() -> HTMLResponse:
    return get_swagger_ui_html(
        openapi_url="/openapi.json",
        title="jitserve - Swagger UI",
        swagger_js_url=f"{DOCS_ASSETS_URL}/swagger-ui-bundle.js",
        swagger_css_url=f"{DOCS_ASSETS_URL}/swagger-ui.css",
        swagger_favicon_url="data:,",
    )


@functools.cache
def _redoc_script() -> bytes:
    """ReDoc's bundle from the installed package, less the one thing it fetches from elsewhere: the logo
    in its sidebar's "API docs by Redocly" link (an empty image instead)."""
    script = (DOCS_ASSETS / "redoc.standalone.js").read_bytes()
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
