"""Request and response bodies of the REST API, as pydantic models: they are
what ``/openapi.json`` documents (client generators and API fuzzers read it)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .runtime.generation.sampling import SamplingParameters
from .runtime.models.state import BucketState, TuningStatus


class ErrorBody(BaseModel):
    """Every error: the right status code and one message naming the problem."""

    error: str


class OpenVinoBuildDescription(BaseModel):
    key: str | None = Field(None, description="what it was built from; a shadow check's demotion keeps it off")
    precision: str = Field(description="f32, or the reduced precision it runs in (bf16, f16, f16-weights)")
    build_seconds: float | None = None
    bytes: int | None = Field(None, description="memory it holds (its own copy of the weights), counted in the cache")
    verification: str | None = Field(
        None, description="its comparison with onnxruntime on the bucket: a reduced precision's measured error"
    )
    failure: str | None = Field(None, description="why it cannot serve the bucket: not built, or not verified")


class Bf16KernelDescription(BaseModel):
    key: str | None = Field(None, description="its kernel in the store; a shadow check's demotion keeps it off")
    verification: str | None = Field(None, description="its measured error against onnxruntime, within the budget")
    kernels_in_bf16: int | None = Field(None, description="its kernels whose products are in bf16")
    failure: str | None = Field(None, description="why it cannot serve the bucket: not compiled, or not verified")


class Bucket(BaseModel):
    bucket: str = Field(description="canonical label, e.g. x=8x3x48x192")
    shapes: dict[str, list[int | str]] = Field(
        description="the bucket's shape per input; a dynamic axis's name where one symbolic kernel serves its range"
    )
    state: BucketState
    reason: str | None = Field(
        description="why it is in its state: why a cold bucket is not compiled yet, why a compile failed"
    )
    engine: str = Field(
        description="the engine serving it: onnxruntime, tvm, tvm-tuned, openvino, or a reduced precision's "
        "(tvm-bf16, openvino-bf16, openvino-f16, openvino-f16-weights) where the model's precision contract allows"
    )
    latency_ms: dict[str, float] = Field(description="measured median latency per verified engine")
    routed_by: Literal["latency", "throughput"] = Field(
        "latency",
        description="what chose the engine: one request's latency, or (when its requests have run side by side) "
        "requests per second at that many concurrent callers",
    )
    throughput_rps: dict[str, float] = Field(
        default_factory=dict, description="per engine, requests per second at peak_concurrency callers (by throughput)"
    )
    peak_concurrency: int = Field(1, description="most of the bucket's requests seen running at once")
    padded_error: dict[str, float] = Field(
        description="per kernel, its largest absolute difference from onnxruntime on the bucket's most padded "
        "request (an approximate axis's kernel serves only within its tolerance)"
    )
    demoted: dict[str, str] = Field(
        default_factory=dict,
        description="kernel key -> why a shadow check took it off the bucket (it answered a served request "
        "differently from onnxruntime): never routed again",
    )
    compile_seconds: float | None
    kernel: str = Field(
        description="the key of the bucket's kernel in the store: the same for every version and model with this "
        "graph (weights are parameters), whether compiled yet or not"
    )
    openvino: dict[str, OpenVinoBuildDescription] | None = Field(
        None,
        description="per OpenVINO engine (openvino in fp32; openvino-bf16 and the like where the model's precision "
        "contract allows), its build for the bucket: none before the bucket is routed, or where OpenVINO is off",
    )
    tvm_bf16: Bf16KernelDescription | None = Field(
        None,
        description="TVM's bf16 kernel of the bucket where the model's precision contract allows bf16 (compiled on "
        "a CPU with AVX512-BF16 or AMX): verified within the contract's budget, or why it cannot serve",
    )
    hits: int = Field(description="requests served from this bucket")
    traffic: float = Field(
        description="recent requests, each decaying over the compile admission window: orders compiles and evictions"
    )
    warm: bool = Field(description="compiled right after upload")
    tuning: TuningStatus | None


class AxisDescription(BaseModel):
    policy: dict[str, Any] = Field(description="the configured bucket policy")
    effective_policy: str = Field(description="the policy in force: exact unless padding was found safe")
    padding_safety: dict[str, Any] | None = Field(
        description="the padding-safety check's result; null until the padding probe has judged the axis"
    )


class PaddingProbeDescription(BaseModel):
    state: str = Field(
        description="pending (waiting for a probe slot), running, done (its verdicts in force) or failed (the "
        "axes it judges are served exactly); until it ends, requests are served by onnxruntime at their exact "
        "shape and no bucket is compiled"
    )
    seconds: float | None = Field(
        description="the probe's wall time (so far, while it runs); null when none ran in this process"
    )
    error: str | None = Field(description="why the probe failed")


class BatchingGroup(BaseModel):
    bucket: str = Field(description="the group's batch-1 bucket (requests alike on every axis but the batch's)")
    batches: bool = Field(description="whether its requests go through the batcher")
    reason: str = Field(description="why: a batched row's measured run against a lone request's")


class BatchingDescription(BaseModel):
    enabled: bool = Field(description="whether concurrent requests are joined into one run")
    reason: str = Field(description="the batch axis it joins along, or why batching is off")
    max_batch_size: int
    max_queue_delay_us: int
    preferred_batch_sizes: list[int] | None
    groups: list[BatchingGroup] = Field(
        default_factory=list, description="per group of requests seen, whether batching pays (rows get cheaper)"
    )


class CompileAdmissionDescription(BaseModel):
    storm: bool = Field(description="new buckets arrive faster than compiles may be admitted: none are")
    new_buckets_in_window: int
    compiled_buckets: int = Field(description="buckets compiled, compiling or admitted (warm ones apart)")
    max_compiled_buckets: int
    compiles_admitted_in_window: int = Field(description="over all models")


class WeightsDescription(BaseModel):
    prepared_bytes: int | None = Field(None, description="the version's weights as stored (mapped once per version)")
    resident_bytes: int | None = Field(
        None, description="of those, the mapped pages resident: weights a transform consumed are given back"
    )
    transformed_bytes: int | None = Field(
        None,
        description="what the kernels' weight transforms computed (matmul panels, channel-blocked conv weights), "
        "once per layout: buckets whose kernels read the same layout share one copy",
    )
    transformed_ratio: float | None = Field(
        None, description="transformed_bytes over prepared_bytes (bounded by max_transformed_weights_ratio)"
    )
    transformed_outputs: int | None = Field(None, description="distinct transformed weights computed")
    openvino_bytes: int | None = Field(
        None, description="what the version's models compiled by OpenVINO hold, once for all its buckets"
    )


class ModelDescription(BaseModel):
    name: str
    version: int
    digest: str = Field(description="sha256 of the ONNX bytes")
    target: dict[str, Any] = Field(description="the compile target as a TVM target dict")
    signature: dict[str, Any] = Field(description="inputs and outputs with dtypes and dims")
    axes: dict[str, AxisDescription]
    padding_probe: PaddingProbeDescription = Field(
        description="the padding-safety check of the axes, which runs after the upload answers"
    )
    overflow: str
    dynamic_batching: BatchingDescription | None = Field(None, description="null: not configured")
    buckets: list[Bucket]
    compile_admission: CompileAdmissionDescription
    weights: WeightsDescription | None = Field(
        None, description="the version's weights as its engines hold them; null while no kernel holds them"
    )
    generation: dict[str, Any] | None = Field(
        None,
        description="a decoder with a key/value cache: what was recognised (its cache's layers, heads, "
        "positions), its running and waiting sequences and cache blocks; null for any other model",
    )


class GenerateRequest(BaseModel):
    """Triton's generate extension, in token ids: the prompt and the sampling parameters."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"input_ids": [464, 3290, 318], "parameters": {"max_tokens": 8}}]},
    )

    input_ids: list[int] | None = Field(None, description="the prompt's token ids (or text_input)")
    text_input: str | None = Field(
        None, description="the prompt as text, where the model was uploaded with a tokenizer.json (or input_ids)"
    )
    parameters: SamplingParameters = Field(default_factory=SamplingParameters)


class GenerateResponse(BaseModel):
    model_name: str
    model_version: str
    output_ids: list[int] = Field(description="the generated token ids (a stop token included)")
    text_output: str | None = Field(None, description="the generated text, where the model has a tokenizer")
    finish_reason: str = Field(description="stop: a stop token; length: max_tokens or the model's positions")


class ModelList(BaseModel):
    models: list[ModelDescription]


DEMO_ROW = [0.5, -1.0, 2.0, 0.0]
DEMO_INPUTS = {"x": [DEMO_ROW]}
DEMO_TENSOR = {"name": "x", "datatype": "FP32", "shape": [1, 4], "data": DEMO_ROW}


class ModelPredictRequest(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"inputs": DEMO_INPUTS}]})

    inputs: dict[str, Any] = Field(description="input name -> nested list of numbers")


class PredictRequest(ModelPredictRequest):
    model_config = ConfigDict(json_schema_extra={"examples": [{"model": "demo", "inputs": DEMO_INPUTS}]})

    model: str = Field(description="the model's name")


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


def json_error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The same, for a route whose success is not JSON (FastAPI would give its errors that media type)."""
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
    return {code: {"description": "Error", "content": error} for code in codes}


# -- Open Inference Protocol (KServe V2) ---------------------------------------


class V2ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class V2Live(BaseModel):
    live: bool


class V2Ready(BaseModel):
    ready: bool


class V2ModelReady(BaseModel):
    name: str
    ready: bool


class V2TensorMetadata(BaseModel):
    name: str
    datatype: str = Field(description="BOOL, INT8..INT64, UINT8..UINT64, FP16, FP32, FP64")
    shape: list[int] = Field(description="-1 for a symbolic dim")


class V2ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[V2TensorMetadata]
    outputs: list[V2TensorMetadata]


class V2Tensor(BaseModel):
    name: str
    datatype: str
    shape: list[int]
    parameters: dict[str, Any] | None = Field(None, description="binary_data_size with binary tensor data")
    data: list[Any] | None = Field(None, description="the values, flattened in row-major order")


class V2RequestedOutput(BaseModel):
    name: str
    parameters: dict[str, Any] | None = Field(None, description='{"binary_data": true} for a binary output')


class V2InferRequest(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"inputs": [DEMO_TENSOR]}]})

    id: str | None = None
    parameters: dict[str, Any] | None = Field(None, description='{"binary_data_output": true}: every output binary')
    inputs: list[V2Tensor]
    outputs: list[V2RequestedOutput] | None = None


class V2InferResponse(BaseModel):
    model_name: str
    model_version: str
    id: str | None = None
    outputs: list[V2Tensor]


class V2RepositoryModel(BaseModel):
    name: str
    version: str | None = None
    state: str = Field(description="READY (served) or UNAVAILABLE (stored, unloaded)")
    reason: str
