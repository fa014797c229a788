"""The parts of an upload that need no lock: the config parsed and checked against the model, its sizes
against the limits (warm buckets before the padding probe has judged the axes: at their largest), the
compile options and target, and the ONNX Runtime session that serves it from the first request."""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from compiler.building.options import CompileOptions
from compiler.building.target import resolve_target
from compiler.errors import BadRequestError, InvalidModelError
from compiler.models.decoder import recognize_decoder
from compiler.models.memory import check_model_fits, check_sizes_fit
from compiler.models.model import LoadedModel
from compiler.running.engines import SPIN_WITHIN_RUNS, OrtEngine
from compiler.running.precision import budget_for
from compiler.shapes.buckets import AxisPolicy, AxisSafety, Bucket, BucketPlanner, bucket_label

from ...settings import Settings
from .records import ModelConfig


def model_target(settings: Settings, config: ModelConfig, kernel_threads: int) -> dict:
    """The compile target: the config's, else the settings'."""
    try:
        return resolve_target(config.target or settings.target, cuda_arch=settings.cuda_arch, num_cores=kernel_threads)
    except ValueError as exc:
        raise BadRequestError(f"config: {exc}") from None


def open_onnxruntime(settings: Settings, model: LoadedModel, target: dict) -> OrtEngine:
    """The model's ONNX Runtime session (its CUDA provider for a CUDA target). A decoder's is its generation
    loop's, called step after step by one thread: it gets ``generate_ort_threads``, spinning while a call
    lasts."""
    decoder = recognize_decoder(model.signature, model.index_bounds) is not None
    if decoder:
        threads, spinning = settings.generate_ort_threads or settings.kernel_threads, SPIN_WITHIN_RUNS
    else:
        threads, spinning = settings.ort_threads or settings.kernel_threads, settings.ort_spinning
    try:
        return OrtEngine(model.data, cuda=target["kind"] == "cuda", threads=threads or None, spinning=spinning)
    except Exception as exc:  # noqa: BLE001 - ORT raises its own exception types
        raise InvalidModelError(f"onnxruntime cannot load the model: {exc}") from None


def compile_options(
    settings: Settings, config: ModelConfig, database_dir: Path, *, quantized: bool = False
) -> CompileOptions:
    """How the model's kernels are compiled and verified: the config's tolerances over the settings'; a
    quantized model's within its contract's budget where the contract allows int8 (the compiled tier's
    integer arithmetic is not ONNX Runtime's, :func:`compiler.running.precision.budget_for`)."""
    return CompileOptions(
        rtol=config.rtol or settings.verify_rtol,
        atol=config.atol or settings.verify_atol,
        seed=settings.verify_seed,
        timeout_seconds=settings.compile_timeout_seconds,
        memory_limit_bytes=settings.compile_memory_bytes,
        database_dir=str(database_dir),
        shipped_tuning=settings.shipped_tuning,
        nice=settings.compile_nice,
        idle_priority=settings.compile_idle_priority,
        explain=settings.explain_bundles,
        budget=budget_for("tvm", config.precision, quantized),
    )


def check_served_sizes(model: LoadedModel, settings: Settings) -> None:
    """A model whose tensors or count of symbolic axes are past the settings' limits is refused at once."""
    check_model_fits(model.proto, model.signature, settings.max_tensor_bytes)
    axes, limit = len(model.signature.axes()), settings.max_symbolic_axes
    if axes > limit:
        raise BadRequestError(f"the model has {axes} symbolic axes; at most {limit} are served (max_symbolic_axes)")


def parse_config(model: LoadedModel, config: dict | None) -> ModelConfig:
    """The upload's config, checked against the model's axes and inputs."""
    try:
        parsed = ModelConfig.model_validate(config or {})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise BadRequestError(f"invalid config at {where or 'top level'}: {first['msg']}") from None
    axes = model.signature.axes()
    for axis in parsed.axes:
        if axis not in axes:
            raise BadRequestError(f"config names axis {axis!r}; the model's symbolic axes are {sorted(axes)}")
    for axis in parsed.probe_sizes:
        if axis not in axes:
            raise BadRequestError(f"config probe_sizes names axis {axis!r}; the model's axes are {sorted(axes)}")
    for name in parsed.pad_values:
        if name not in model.signature.input_names:
            raise BadRequestError(f"config pad_values names unknown input {name!r}")
    batching, axis = parsed.dynamic_batching, model.signature.leading_axis()
    if batching is not None and axis is not None:
        largest = parsed.policy_for(axis).largest
        if largest is not None and batching.max_batch_size > largest:
            raise BadRequestError(
                f"config dynamic_batching.max_batch_size {batching.max_batch_size} is beyond "
                f"the largest bucket of axis {axis!r} ({largest})"
            )
    return parsed


def warm_buckets(model: LoadedModel, config: ModelConfig, planner: BucketPlanner) -> list[Bucket]:
    """The buckets the config's warm shapes fall in, each once."""
    found: dict[str, Bucket] = {}
    for shapes in config.warm_buckets:
        plan = planner.plan(model.signature.with_static_inputs({k: tuple(v) for k, v in shapes.items()}))
        found.setdefault(bucket_label(plan.bucket), plan.bucket)
    return list(found.values())


def assumed_padding_safe(
    model: LoadedModel, config: ModelConfig, policies: dict[str, AxisPolicy], safety: dict[str, AxisSafety]
) -> BucketPlanner:
    """A planner for checking warm buckets before the probe has judged the axes: each axis it judges taken
    as padding-safe, which gives the largest buckets and the policies' overflow errors (whatever the probe
    finds, the warm buckets are no larger)."""
    assumed = {
        axis: safety.get(axis) or AxisSafety(axis=axis, safe=True, reason="assumed safe to check the warm buckets")
        for axis in policies
    }
    return BucketPlanner(model.signature, policies, assumed, config.overflow, warm_sizes(model, config))


def check_warm_sizes(model: LoadedModel, policies: dict[str, AxisPolicy], warm: list[Bucket], limit: int) -> None:
    """Warm buckets are compiled and verified at their bucket shapes; dynamic axes at their range's end."""
    signature = model.signature
    for bucket in warm:
        sizes = {
            axis: dim
            for spec in signature.inputs
            for index, axis in spec.symbolic_axes()
            if isinstance(dim := bucket[spec.name][index], int)
        }
        check_sizes_fit(signature, sizes, limit, f"warm bucket {bucket_label(bucket)}")
    for axis, policy in policies.items():
        if policy.kind == "dynamic":
            check_sizes_fit(signature, {axis: policy.max}, limit, f"axes.{axis} dynamic max")


def warm_sizes(model: LoadedModel, config: ModelConfig) -> dict[str, set[int]]:
    """Axis -> the sizes the warm buckets give it."""
    sizes: dict[str, set[int]] = {}
    for shapes in config.warm_buckets:
        for spec in model.signature.inputs:
            shape = shapes.get(spec.name, [])
            for index, axis in spec.symbolic_axes():
                if index < len(shape):
                    sizes.setdefault(axis, set()).add(int(shape[index]))
    return sizes
