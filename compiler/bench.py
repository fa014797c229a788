"""Latency of compiled kernels against ONNX Runtime, measured in one process.

Both engines get the same seeded input; runs alternate between engines so
that machine noise hits both alike; the median of the runs is reported.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from .arrays import random_inputs
from .buckets import Bucket, bucket_label
from .build import CompileOptions, compile_bucket
from .engines import Engine, OrtEngine, TvmEngine
from .model import LoadedModel
from .store import ArtifactStore


def _time_once(engine: Engine, inputs) -> float:
    started = time.perf_counter()
    engine.run(inputs)
    return (time.perf_counter() - started) * 1000


def median_latencies_ms(engines: dict[str, Engine], inputs, *, warmup: int = 3, runs: int = 20) -> dict[str, float]:
    for engine in engines.values():
        for _ in range(warmup):
            engine.run(inputs)
    samples: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(runs):
        for name, engine in engines.items():
            samples[name].append(_time_once(engine, inputs))
    return {name: statistics.median(values) for name, values in samples.items()}


def bench_bucket(
    model: LoadedModel,
    bucket: Bucket,
    target: dict,
    store: ArtifactStore,
    options: CompileOptions,
    *,
    runs: int = 20,
    log: Callable[[str], None] = lambda _: None,
) -> dict:
    outcome = compile_bucket(model, bucket, target, store, options)
    manifest = outcome.manifest
    log(f"{bucket_label(bucket)}: compiled in {manifest.compile_seconds:.1f}s (cached={outcome.cached})")
    signature = model.signature
    engines: dict[str, Engine] = {
        "ort": OrtEngine(model.data, cuda=target["kind"] == "cuda"),
        "tvm": TvmEngine(outcome.library_path, signature.input_names, signature.output_names, device=target["kind"]),
    }
    inputs = random_inputs(bucket, {s.name: s.dtype for s in signature.inputs}, options.seed + 1)
    latency = median_latencies_ms(engines, inputs, runs=runs)
    return {
        "bucket": bucket_label(bucket),
        "target": target["kind"],
        "ort_ms": round(latency["ort"], 3),
        "tvm_ms": round(latency["tvm"], 3),
        "ratio_vs_ort": {"tvm": round(latency["tvm"] / latency["ort"], 2)},
        "compile_seconds": round(manifest.compile_seconds, 2),
        "cached": outcome.cached,
        "verified": manifest.verified,
    }
