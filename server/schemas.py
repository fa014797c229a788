"""Request and response bodies of the REST API, as pydantic models: they are
what ``/openapi.json`` documents (client generators and API fuzzers read it)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from .runtime.state import BucketState, TuningStatus


class ErrorBody(BaseModel):
    """Every error: the right status code and one message naming the problem."""

    error: str


class Bucket(BaseModel):
    bucket: str = Field(description="canonical label, e.g. x=8x3x48x192")
    shapes: dict[str, list[int]] = Field(description="the bucket's shape per input")
    state: BucketState
    reason: str | None = Field(description="why the bucket failed")
    engine: str = Field(description="the engine serving it: onnxruntime, tvm or tvm-tuned")
    latency_ms: dict[str, float] = Field(description="measured median latency per verified engine")
    compile_seconds: float | None
    hits: int = Field(description="requests served from this bucket")
    warm: bool = Field(description="compiled right after upload")
    tuning: TuningStatus | None


class AxisDescription(BaseModel):
    policy: dict[str, Any] = Field(description="the configured bucket policy")
    effective_policy: str = Field(description="the policy in force: exact unless padding was found safe")
    padding_safety: dict[str, Any] | None = Field(description="the padding-safety check's result")


class ModelDescription(BaseModel):
    name: str
    version: int
    digest: str = Field(description="sha256 of the ONNX bytes")
    target: dict[str, Any] = Field(description="the compile target as a TVM target dict")
    signature: dict[str, Any] = Field(description="inputs and outputs with dtypes and dims")
    axes: dict[str, AxisDescription]
    overflow: str
    buckets: list[Bucket]


class ModelList(BaseModel):
    models: list[ModelDescription]


class PredictRequest(BaseModel):
    model: str | None = Field(None, description="the model's name (POST /predict only)")
    inputs: dict[str, Any] = Field(description="input name -> nested list of numbers")


class PredictResponse(BaseModel):
    model: str
    version: int
    outputs: dict[str, Any] = Field(description="output name -> nested list, cut back to the request's shape")
    engine: str = Field(description="the engine that served the request")
    bucket: str


class Health(BaseModel):
    status: str


class Readiness(BaseModel):
    ready: bool
    waiting: list[str] = Field(description="warm buckets still compiling, as model:bucket")


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the error codes a route can answer."""
    return {code: {"model": ErrorBody} for code in codes}
