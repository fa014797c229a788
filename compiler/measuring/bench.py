"""Latency of compiled kernels against ONNX Runtime, measured in one process.

``bench`` times each engine in a single block, ONNX Runtime first: with its
spinning threads (its default) the engines slow each other down whenever
they take turns in one process (measured on 2 cores: TVM up to 1.8x slower
right after ONNX Runtime, ONNX Runtime up to 4x slower after TVM).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

from ..building.build import compile_bucket, open_kernel, profile_kernel
from ..building.matrix_units import host_matrix_units
from ..building.options import CompileOptions
from ..errors import JitServeError
from ..models.model import LoadedModel
from ..running.arrays import random_inputs
from ..running.engines import Engine, OrtEngine
from ..running.precision import compare_within_budget
from ..shapes.buckets import Bucket, bucket_label, is_symbolic
from ..storage.store import KernelStore
from .profile import compare_by_class, format_profile, kernel_profile, ort_profile
from .timing import median_latencies_ms
from .tuning_plan import kernel_times


def bench_bucket(
    model: LoadedModel,
    bucket: Bucket,
    target: dict,
    store: KernelStore,
    options: CompileOptions,
    *,
    runs: int = 20,
    tune_trials: int = 0,
    tune_trials_per_task: int = 16,
    ort_threads: int | None = None,
    ort_spinning: bool = True,
    profile: bool = False,
    openvino: bool = False,
    log: Callable[[str], None] = lambda _: None,
) -> dict:
    """Compile (and optionally tune) one bucket, and build OpenVINO for it where ``openvino``; time every
    verified engine in this process."""
    signature = model.signature
    kind = target["kind"]
    ort = OrtEngine(model.data, cuda=kind == "cuda", threads=ort_threads, spinning=ort_spinning)
    engines: dict[str, Engine] = {"ort": ort}
    tiers = {"tvm": options}
    if tune_trials:
        tiers["tvm_tuned"] = options.model_copy(
            update={
                "tune_trials": tune_trials,
                "tune_trials_per_task": tune_trials_per_task,
                "database_dir": str(store.tuning_database),
            }
        )
    if kind == "cuda" and not is_symbolic(bucket) and not options.cuda_graph:
        tiers["tvm_graph"] = options.model_copy(update={"cuda_graph": True})  # a launch per kernel saved
    facts: dict = {
        "bucket": bucket_label(bucket),
        "target": kind,
        "precision": precisions(model, kind, options.precision),
    }
    ranking: dict = {}
    for tier, tier_options in tiers.items():
        outcome = compile_bucket(model, bucket, target, store, tier_options, kernel_times=ranking)
        manifest = outcome.manifest
        if tune_trials and tier == "tvm" and manifest.verified:  # the kernels that lose most are tuned first
            ranking = _tuning_ranking(model, manifest, store, bucket, options, threads=ort_threads, log=log)
        log(f"{bucket_label(bucket)} {tier}: built in {manifest.compile_seconds:.1f}s (cached={outcome.cached})")
        engines[tier] = open_kernel(model, outcome, store, kind)
        if tier == "tvm":
            facts |= {"compile_seconds": round(manifest.compile_seconds, 2), "cached": outcome.cached}
        elif tier == "tvm_graph":
            facts["cuda_graph"] = manifest.cuda_graph
        else:
            tuning = manifest.tuning or {}
            facts |= {
                "tune_seconds": round(tuning.get("tune_seconds", 0.0), 1),
                "tune_trials": tuning.get("trials"),
                "tune_plan": tuning.get("plan"),
            }
        facts[f"{tier}_verified"] = manifest.verified
        facts[f"{tier}_unscheduled"] = manifest.unscheduled
    dtypes = {s.name: s.dtype for s in signature.inputs}
    if openvino and kind == "llvm":
        openvino_engine, openvino_facts = _openvino(model, bucket, ort, options, store, threads=ort_threads, log=log)
        facts |= openvino_facts
        if openvino_engine is not None:
            engines["openvino"] = openvino_engine
    inputs = random_inputs(bucket, dtypes, options.seed + 1, model.index_bounds.limits)
    latency = median_latencies_ms(engines, inputs, runs=runs, block=runs)
    ort_ms = latency.pop("ort")
    if profile:
        facts["profile"] = _profile(model, engines, inputs, ort_threads, log)
    peer_ms = min(ort_ms, latency.get("openvino", ort_ms))  # the engine a TVM kernel must beat to serve
    return {
        **facts,
        "ort_ms": round(ort_ms, 3),
        **{f"{tier}_ms": round(ms, 3) for tier, ms in latency.items()},
        "peer_ms": round(peer_ms, 3),
        "ratio_vs_ort": {tier: round(ms / ort_ms, 2) for tier, ms in latency.items()},
        "ratio_vs_peer": {tier: round(ms / peer_ms, 2) for tier, ms in latency.items() if tier != "openvino"},
    }


def precisions(model: LoadedModel, kind: str, compiled: str = "fp32") -> dict[str, str]:
    """The arithmetic each engine runs the model in: a quantized model's integer ops in int8 on ONNX
    Runtime, and on TVM where the compiled tier keeps them in integers (on the CPU's unit), else in fp32;
    ``compiled``: the precision TVM was asked for (``bf16``: its matmuls by weights)."""
    if not model.integer_ops:
        tvm = f"bf16 ({host_matrix_units().unit('bf16')})" if compiled == "bf16" else "fp32"
        return {"onnxruntime": "fp32", "tvm": tvm, "openvino": "fp32"}
    unit = host_matrix_units().unit("int8") if kind == "llvm" else None
    tvm = f"int8 ({unit})" if unit and model.integer_refusal is None else "fp32 (its integer ops run in float)"
    return {"onnxruntime": "int8", "tvm": tvm, "openvino": "int8"}


def _openvino(model, bucket, ort, options, store, *, threads, log) -> tuple[Engine | None, dict]:
    """OpenVINO built for the bucket and verified against ONNX Runtime (None where it did not verify), and
    the facts of it."""
    from ..running.openvino_engine import OpenVinoEngine, verify_openvino

    started = time.perf_counter()
    try:
        engine = OpenVinoEngine.static(
            model.data, dict(bucket), model.signature.output_names, threads=threads,
            ir_dir=store.staging_area.entry("openvino"),
        )  # fmt: skip
    except JitServeError as exc:
        log(f"{bucket_label(bucket)} openvino: {exc}")
        return None, {"openvino_verified": False, "openvino_error": str(exc)}
    seconds = time.perf_counter() - started
    dtypes = {s.name: s.dtype for s in model.signature.inputs}
    within = None if options.budget is None else partial(compare_within_budget, budget=options.budget)
    verified, detail = verify_openvino(
        engine, ort, bucket, dtypes, rtol=options.rtol, atol=options.atol, seed=options.seed,
        index_limits=model.index_bounds.limits, steps=model.output_steps, compare=within,
    )  # fmt: skip
    log(f"{bucket_label(bucket)} openvino: built in {seconds:.1f}s, {engine.nbytes / 2**20:.0f} MiB, {detail}")
    facts = {"openvino_verified": verified, "openvino_seconds": round(seconds, 2), "openvino_bytes": engine.nbytes}
    return (engine if verified else None), facts


def _tuning_ranking(model, manifest, store, bucket, options, *, threads, log) -> dict:
    """The untuned kernel's explain profile, which ranks the tuning tasks; empty where it cannot be made."""
    try:
        shapes = {name: list(dims) for name, dims in bucket.items()}
        return kernel_times(profile_kernel(model, manifest, store, shapes, options, threads=threads))
    except JitServeError as exc:
        log(f"{bucket_label(bucket)}: tuning ranked by kernel time alone (no profile: {exc})")
        return {}


def _profile(model: LoadedModel, engines: dict[str, Engine], inputs, ort_threads: int | None, log) -> dict:
    """Each TVM tier's per-kernel profile beside ONNX Runtime's per-node one, logged as text."""
    ort_side = ort_profile(model.data, inputs, threads=ort_threads)
    report: dict = {"onnxruntime": ort_side.as_dict()}
    for tier, engine in engines.items():
        if tier in ("ort", "openvino"):  # OpenVINO keeps its per-node times to itself
            continue
        tvm_side = kernel_profile(engine, inputs)
        log(format_profile(tier, tvm_side, ort_side))
        report[tier] = tvm_side.as_dict() | {"by_class": compare_by_class(tvm_side, ort_side)}
    return report


def plot_ratios(results: list[dict], path: str, *, title: str = "") -> None:
    """Bar chart of each engine's latency / ONNX Runtime's, per bucket (1.0 = parity)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tiers = sorted({tier for r in results for tier in r["ratio_vs_ort"]})
    figure, axes = plt.subplots(figsize=(max(4, 1.6 * len(results) * len(tiers)), 3.5))
    width = 0.8 / max(1, len(tiers))
    for i, tier in enumerate(tiers):
        xs = [j + i * width for j in range(len(results))]
        axes.bar(xs, [r["ratio_vs_ort"].get(tier, 0) for r in results], width, label=tier)
    axes.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    axes.set_xticks([j + width * (len(tiers) - 1) / 2 for j in range(len(results))])
    axes.set_xticklabels([r["bucket"] for r in results], fontsize=8)
    axes.set_ylabel("latency / ONNX Runtime")
    if max(r["ratio_vs_ort"].get(t, 0) for r in results for t in tiers) > 10:
        axes.set_yscale("log")  # bars from 0 would hide the small ratios
    axes.set_title(title)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
