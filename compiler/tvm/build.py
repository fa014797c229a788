"""The TVM side of a compile. Runs inside the compile child process only.

prepared graph (weights as inputs, see :mod:`compiler.tvm.prepare`) ->
specialize (fix shapes, fold shape subgraphs) -> import to Relax -> the
target's default Relax pipeline (fusion; dlight schedules on GPU) -> export
``kernel.so`` (code only: the weights are parameters) -> verify against ONNX
Runtime, on the model as uploaded, on seeded random inputs. Each stage is
timed (``compile_stages`` in the manifest).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import onnx
import onnxsim
import tvm

from ..building.cuda_math import use_exact_cuda_math
from ..building.options import BuildJob, read_source
from ..errors import CompileError, UnsupportedOperatorError
from ..measuring.profile import named_nodes
from ..models.memory import anonymous_resident_bytes
from ..models.signature import fix_input_shapes
from ..models.weights import GRAPH_NAME, load_weights
from ..running.arrays import Comparison, compare_outputs, random_inputs
from ..running.engines import OrtEngine, TvmEngine
from ..running.precision import AccuracyBudget, compare_within_budget
from ..shapes.buckets import dim_step, is_symbolic
from . import COMPILER_VERSION
from .bf16 import PRECISION_ATTR
from .cuda_graphs import CUDA_GRAPH_ATTR, CUDA_GRAPH_OPTION
from .explain import StageRecorder, write_bundle
from .main_rewrite import with_integer_weights
from .onnx_import import import_onnx, read_steps
from .pipeline import build_pipeline
from .tuning import tune
from .tuning_database import SHIPPED_DIR, open_shared_database


def specialize(model: onnx.ModelProto, bucket: dict[str, tuple], simplify: bool) -> tuple[onnx.ModelProto, bool]:
    """Fix the input shapes and fold the shape subgraphs TVM cannot import.

    Returns the model and whether onnxsim simplified it; a model onnxsim
    cannot handle is still tried with only its shapes fixed. A symbolic bucket's
    dims are written into the model first and onnxsim folds what the fixed dims
    determine (PP-OCR rec's Shape -> Concat -> Reshape chains become constants). Unnamed nodes are named
    first (in place), as ONNX Runtime's profile will know them: onnxsim would name them its own way.
    """
    named_nodes(model)
    fixed = fix_input_shapes(model, bucket)
    if simplify:
        try:
            if is_symbolic(bucket):
                simplified, ok = onnxsim.simplify(fixed)
            else:
                simplified, ok = onnxsim.simplify(model, overwrite_input_shapes={k: list(v) for k, v in bucket.items()})
            if ok:
                return simplified, True
        except Exception:  # noqa: BLE001 - onnxsim raises anything; fall back below
            pass
    return fixed, False


def _last_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def import_relax(model: onnx.ModelProto, bucket: dict[str, tuple], dtypes: dict[str, str]):
    return import_with_provenance(model, bucket, dtypes)[0]


def import_with_provenance(model: onnx.ModelProto, bucket: dict[str, tuple], dtypes: dict[str, str]):
    """The Relax module, and the importer's record of the ONNX node behind each binding."""
    # A named dim becomes one tirx.Var per name, shared by every input that has it (a plain string fails);
    # a dim with a step is ``step * var``, the var counting steps.
    variables = {d: tvm.tirx.Var(d, "int64") for shape in bucket.values() for d in shape if isinstance(d, str)}
    steps = [(variables[d], dim_step(d)) for d in variables if dim_step(d) > 1]

    def dim(d):
        if not isinstance(d, str):
            return d
        return variables[d] * dim_step(d) if dim_step(d) > 1 else variables[d]

    shapes = {name: [dim(d) for d in v] for name, v in bucket.items()}
    try:
        mod, importer = import_onnx(model, shape_dict=shapes, dtype_dict=dict(dtypes))
        # The weights are parameters, not inputs: tuning and LiftTransformParams read this attribute.
        mod["main"] = mod["main"].with_attr("num_input", len(bucket))
        return read_steps(mod, steps), importer
    except tvm.error.OpNotImplemented as exc:
        raise UnsupportedOperatorError(f"TVM cannot import this model: {_last_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - the importer raises many types
        raise CompileError(f"TVM import failed: {type(exc).__name__}: {_last_line(exc)}") from None


def compile_relax(
    mod,
    target_dict: dict,
    database=None,
    stage_seconds: dict[str, float] | None = None,
    observed: dict | None = None,
    *,
    symbolic_bounds: dict[str, tuple[int, int]] | None = None,
    snapshot=None,
    precision: str = "fp32",
    cuda_graph: bool = False,
):
    """Build ``mod``; ``stage_seconds`` receives the Relax pipeline's stages, ``observed`` its schedule digest;
    ``symbolic_bounds``: each symbolic dim's range, which the schedules plan with; ``snapshot``: called
    with each stage's name and module (an explain bundle's record); ``precision``: ``"bf16"`` computes the
    matmuls by weights in bf16 (:mod:`compiler.tvm.bf16`), ``"f16"`` (CUDA) the large matmuls on tensor cores
    (:mod:`compiler.tvm.tensor_cores`); ``cuda_graph`` (CUDA): the kernels captured as CUDA graphs
    (:mod:`compiler.tvm.cuda_graphs`)."""
    target = tvm.target.Target(target_dict)
    if precision != "fp32":
        mod = mod.with_attr(PRECISION_ATTR, precision)
    if cuda_graph:
        if target.kind.name != "cuda":
            raise CompileError(f"CUDA graphs are for the cuda target, not {target.kind.name}")
        mod = mod.with_attr(CUDA_GRAPH_ATTR, True)
    if target.kind.name == "cuda":
        use_exact_cuda_math()
    try:
        pipeline = build_pipeline(target, database, stage_seconds, observed, symbolic_bounds, snapshot=snapshot)
        graphs = tvm.transform.PassContext(config={CUDA_GRAPH_OPTION: True}) if cuda_graph else nullcontext()
        with graphs:
            return tvm.compile(mod, target, relax_pipeline=pipeline)
    except Exception as exc:  # noqa: BLE001
        raise CompileError(f"TVM build failed: {type(exc).__name__}: {_last_line(exc)}") from None


class StageClock:
    """Wall time per named stage, in order."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, stage: str, *, after: dict[str, float] | None = None) -> None:
        """The time since the last lap is ``stage``'s; ``after``: stages timed within it, which come first
        and leave ``stage`` the rest."""
        now = time.perf_counter()
        inner = after or {}
        self.seconds.update(inner)
        self.seconds[stage] = self.seconds.get(stage, 0.0) + now - self._last - sum(inner.values())
        self._last = now

    def rounded(self) -> dict[str, float]:
        return {stage: round(seconds, 3) for stage, seconds in self.seconds.items()}


def cuda_available() -> bool:
    return bool(tvm.cuda(0).exist)


def weight_parameters(specialized: onnx.ModelProto, input_names: list[str], weights: dict) -> list[str]:
    """The weights the kernel takes after the model's inputs, in order; the inputs must come first."""
    names = [value.name for value in specialized.graph.input]
    if names[: len(input_names)] != list(input_names):
        raise CompileError(f"the prepared graph's inputs {names[: len(input_names)]} are not the model's {input_names}")
    extra = names[len(input_names) :]
    unknown = [name for name in extra if name not in weights]
    if unknown:
        raise CompileError(f"the prepared graph takes inputs that are no weights: {unknown[:3]}")
    return extra


def build_and_verify(job: BuildJob) -> dict:
    """Compile ``job`` into ``job.library_path`` and verify it; return the facts."""
    started = time.perf_counter()
    clock = StageClock()
    prepared = Path(job.prepared_dir)
    graph = onnx.load_from_string((prepared / GRAPH_NAME).read_bytes())
    weights = load_weights(prepared)
    clock.lap("load")
    specialized, simplified = specialize(graph, job.bucket, job.simplify)
    weight_names = weight_parameters(specialized, job.input_names, weights)
    clock.lap("simplify")
    mod, importer = import_with_provenance(specialized, job.bucket, job.dtypes)
    clock.lap("import")
    facts = {"simplified": simplified, "weights": weight_names}
    if job.target["kind"] == "llvm":  # what the CPU's integer rewrites decide by (CUDA keeps them in float)
        mod = with_integer_weights(mod, {name: weights[name] for name in weight_names})
    if job.tune_trials:
        facts["tuning"] = tune(
            mod,
            job.target,
            trials=job.tune_trials,
            trials_per_task=job.tune_trials_per_task,
            database_dir=job.database_dir,
            progress_path=job.progress_path,
            rpc=(job.rpc_tracker, job.rpc_key) if job.rpc_tracker else None,
            kernel_times=job.kernel_times,
            seconds=job.tune_seconds,
            shipped_dir=SHIPPED_DIR if job.shipped_tuning else None,
        )
        clock.lap("tune")
    pipeline_stages: dict[str, float] = {}
    observed: dict = {}
    bounds = {  # the range of each symbolic var: of a dim's size, or of its count of steps
        name: (min(sizes) // dim_step(name), max(sizes) // dim_step(name))
        for name, sizes in (job.verify_sizes or {}).items()
        if sizes
    }
    shipped = SHIPPED_DIR if job.shipped_tuning else None
    database = open_shared_database(job.database_dir, tvm.target.Target(job.target), shipped_dir=shipped)
    recorder = StageRecorder(mod) if job.explain_dir else None
    executable = compile_relax(
        mod, job.target, database, pipeline_stages, observed, symbolic_bounds=bounds, snapshot=recorder,
        precision=job.precision, cuda_graph=job.cuda_graph,
    )  # fmt: skip
    facts["schedule_digest"] = observed.get("schedule_digest")
    facts["schedules"] = observed.get("schedules")
    facts["weight_outputs"] = observed.get("weight_outputs")
    facts["cuda_graph"] = observed.get("cuda_graph")
    clock.lap("codegen", after=pipeline_stages)  # the rest of tvm.compile: TIR lowering, LLVM/NVCC
    executable.export_library(job.library_path)
    clock.lap("export")
    source = read_source(job.model_source)  # the bundle's summary and verification's reference: read once
    if job.explain_dir:
        explained = write_bundle(
            job.explain_dir,
            source=onnx.load_from_string(source),
            specialized=specialized,
            importer=importer,
            stages=recorder,
            executable=executable,
            bucket=job.bucket,
            verify_sizes=job.verify_sizes,
            code=job.explain_code,
            schedules=facts["schedules"],
            units=observed.get("units"),
            stamp={
                "compiler_version": COMPILER_VERSION,
                "tvm": tvm.__version__,
                "onnx": onnx.__version__,
                "onnxsim": onnxsim.__version__,
                "target": job.target,
                "simplified": simplified,
            },
        )
        facts["explain_coverage"] = explained["compute_coverage"]
        clock.lap("explain")
    facts["compile_seconds"] = time.perf_counter() - started
    facts["compile_stages"] = clock.rounded()

    on_cuda = job.target["kind"] == "cuda"
    if on_cuda and not cuda_available():
        return facts | {"verified": None, "verification": "skipped: no CUDA device here", "max_abs_error": None}

    device = job.target["kind"]
    kernel = TvmEngine(
        job.library_path, job.input_names, job.output_names, device=device, weights=[weights[n] for n in weight_names]
    )
    anonymous_before = anonymous_resident_bytes()  # after the weight transform: the version's, not the kernel's
    # Every kernel run first, with ONNX Runtime not loaded yet: the anonymous memory the process grew by,
    # less the arrays still held, is what the loaded kernel keeps beyond its code and the (mapped) weights:
    # the VM's pooled workspace.
    # A symbolic bucket's kernel checks at run time what its dims must agree on, and may refuse a size: where
    # ONNX Runtime refuses it too, that is agreement (YOLOv8n's levels meet only at some heights).
    answer = _answer if is_symbolic(job.bucket) else (lambda engine, inputs: engine.run(inputs))
    runs = []  # (where, inputs, kernel's outputs or the error it refused them with)
    for shapes in verification_shapes(job):
        inputs = random_inputs(shapes, job.dtypes, job.seed, job.index_limits)
        runs.append((_label(shapes), inputs, answer(kernel, inputs)))
    # All zeros too (padding tokens, black images, silence): a kernel that divides by a variance or norm
    # must give what ONNX Runtime gives, NaN where it gives NaN.
    zeros = {name: np.zeros_like(array) for name, array in inputs.items()}
    runs.append((f"all-zero {_label(shapes)}", zeros, answer(kernel, zeros)))
    held = sum(
        a.nbytes for _, ins, outs in runs for a in (*ins.values(), *(outs.values() if isinstance(outs, dict) else ()))
    )
    grown = anonymous_resident_bytes() - anonymous_before - held
    facts["workspace_bytes"] = max(grown, 0) if device == "llvm" else None
    reference = OrtEngine(source, cuda=on_cuda)
    verdicts = [(where, _judge(outputs, answer(reference, inputs), job)) for where, inputs, outputs in runs]
    refused = [where for where, c in verdicts if c.detail == BOTH_REFUSE]
    verdicts = [(where, c) for where, c in verdicts if c.detail != BOTH_REFUSE]
    if not verdicts:  # nothing compared: nothing verified
        verdicts = [(", ".join(refused), Comparison(False, 0.0, None, "ONNX Runtime refuses every size verified"))]
    clock.lap("verify")
    facts["compile_stages"] = clock.rounded()
    failed = [(where, c) for where, c in verdicts if not c.matches]
    where, worst = failed[0] if failed else verdicts[0]
    if failed and (is_symbolic(job.bucket) or where.startswith("all-zero")):  # name the inputs that failed
        detail = f"at {where}: {worst.detail}"
    elif is_symbolic(job.bucket):  # every shape checked
        detail = f"{worst.detail} at {'; '.join(where for where, _ in verdicts)}"
        detail += f"; refused by both at {'; '.join(refused)}" if refused else ""
    else:
        detail = worst.detail
    return facts | {
        "verified": not failed,
        "verification": detail,
        "max_abs_error": max(c.max_abs_error for _, c in verdicts),
    }


BOTH_REFUSE = "refused by both"


def _answer(engine, inputs) -> dict[str, np.ndarray] | Exception:
    """``engine``'s outputs, or the error it refused ``inputs`` with."""
    try:
        return engine.run(inputs)
    except Exception as exc:  # noqa: BLE001 - the VM's shape checks and ONNX Runtime's raise their own types
        return exc


def _judge(outputs, expected, job: BuildJob) -> Comparison:
    """The kernel's answer against ONNX Runtime's: both refused agrees; one refusal alone does not."""
    if isinstance(outputs, Exception) and isinstance(expected, Exception):
        return Comparison(True, 0.0, None, BOTH_REFUSE)
    if isinstance(expected, Exception):
        return Comparison(False, 0.0, None, f"the kernel answers where ONNX Runtime refuses: {_last_line(expected)}")
    if isinstance(outputs, Exception):
        return Comparison(False, 0.0, None, f"the kernel refuses where ONNX Runtime answers: {_last_line(outputs)}")
    if job.budget is not None:
        return compare_within_budget(outputs, expected, AccuracyBudget(**job.budget))
    return compare_outputs(outputs, expected, job.rtol, job.atol)


def verification_shapes(job: BuildJob) -> list[dict[str, tuple[int, ...]]]:
    """The bucket itself; for a symbolic bucket, one shape per verification size of its named dims."""
    if not is_symbolic(job.bucket):
        return [job.bucket]
    sizes = job.verify_sizes or {}
    count = max((len(v) for v in sizes.values()), default=0)
    names = {d for shape in job.bucket.values() for d in shape if isinstance(d, str)}
    if count == 0 or names - set(sizes):
        raise CompileError(f"a symbolic bucket needs verification sizes for {sorted(names)}")
    return [
        {k: tuple(sizes[d][i % len(sizes[d])] if isinstance(d, str) else d for d in v) for k, v in job.bucket.items()}
        for i in range(count)
    ]


def _label(shapes: dict[str, tuple[int, ...]]) -> str:
    return ",".join(f"{name}={'x'.join(map(str, shape))}" for name, shape in shapes.items())
