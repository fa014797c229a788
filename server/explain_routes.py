"""Explain endpoints: a bucket's explain bundle, report page, IR, traces, and an on-demand profile."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, PlainTextResponse
from pydantic import BaseModel, Field, ValidationError

from compiler.errors import BadRequestError

from .auth import require_admin
from .routes import json_body, service_of
from .schemas import error_responses, json_error_responses

router = APIRouter(prefix="/models/{name}/buckets/{bucket}")


def _explanations(request: Request, name: str):
    service = service_of(request)
    return service.explanations, service.get(name)


@router.get("/explain", responses=error_responses(404))
async def explain(name: str, bucket: str, request: Request) -> dict:
    """The bucket's explain bundle: the graph, shape decisions, kernels traced to ONNX nodes, the IR files,
    its profile when one was made, and its compile history (newest first)."""
    explanations, served = _explanations(request, name)
    return await run_in_threadpool(explanations.index, served, bucket)


@router.get("/explain.html", response_class=HTMLResponse, responses=json_error_responses(404))
async def explain_page(name: str, bucket: str, request: Request) -> HTMLResponse:
    """The bundle as a self-contained page: no script, style or font from anywhere else."""
    explanations, served = _explanations(request, name)
    return HTMLResponse(await run_in_threadpool(explanations.html, served, bucket))


@router.get("/explain/ir/{stage}", response_class=PlainTextResponse, responses=json_error_responses(404))
async def explain_ir(name: str, bucket: str, stage: str, request: Request, kernel: str | None = None):
    """The IR after a pipeline stage (``import``, ``legalize``, ..., ``lower``), or one kernel's function
    in it (``?kernel=``)."""
    explanations, served = _explanations(request, name)
    return PlainTextResponse(await run_in_threadpool(explanations.ir, served, bucket, stage, kernel))


@router.get("/explain/code/{module}", response_class=PlainTextResponse, responses=json_error_responses(404))
async def explain_code(name: str, bucket: str, module: str, request: Request):
    """The generated code (``llvm``: assembly), when the bundle holds it."""
    explanations, served = _explanations(request, name)
    return PlainTextResponse(await run_in_threadpool(explanations.ir, served, bucket, module))


@router.get("/explain/trace", responses=error_responses(400, 404))
async def explain_trace(name: str, bucket: str, request: Request, engine: str = "tvm") -> dict:
    """One profiled run of ``engine`` (``tvm`` or ``onnxruntime``) as a Chrome trace (Perfetto opens it)."""
    explanations, served = _explanations(request, name)
    return await run_in_threadpool(explanations.trace, served, bucket, engine)


class ProfileRequest(BaseModel):
    runs: int = Field(10, ge=1, le=1000, description="timed runs per engine")


@router.post(
    "/explain/profile",
    dependencies=[Depends(require_admin)],
    responses=error_responses(400, 401, 404, 409, 500),
    openapi_extra={"requestBody": {**json_body(ProfileRequest), "required": False}},
)
async def explain_profile(name: str, bucket: str, request: Request) -> dict:
    """Time the bucket's kernel call by call and ONNX Runtime node by node on one input, in a child process
    at a compile's priority (one at a time; ``JITSERVE_EXPLAIN_PROFILE_SECONDS`` at most), and keep it in
    the bundle."""
    body = await request.body()
    try:
        runs = ProfileRequest.model_validate_json(body).runs if body.strip() else 10
    except ValidationError as exc:
        raise BadRequestError(f"invalid profile request: {exc.errors()[0]['msg']}") from None
    explanations, served = _explanations(request, name)
    return await run_in_threadpool(explanations.profile, served, bucket, runs=runs)
