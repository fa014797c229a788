"""The dynamic tier against static kernels: one symbolic kernel for a size range, per-size kernels, ONNX Runtime.

    .venv/bin/python loadtest/dynamic_bench.py [--widths 100 320 640] [--range 48 800] [--runs 20]
    .venv/bin/python loadtest/dynamic_bench.py --model det [--widths 480 640 960] [--range 480 960]

rec: compiles PP-OCRv4 rec (batch 1, height 48) once with its width symbolic
over ``--range`` (verified as the server verifies a dynamic bucket) and once
per width in ``--widths`` (static). det: PP-OCRv4 det at square sizes, height
and width both symbolic in steps of 32 (the multiples the detector takes).
Then times every engine at each size in this one process (median of
``--runs``) and prints a Markdown table with the dynamic kernel's ratio to the
static one and to ONNX Runtime, under a line naming the CPU and its vector ISA.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compiler.building.build import compile_bucket, open_kernel
from compiler.building.target import resolve_target
from compiler.models.model import load_model_file
from compiler.running.engines import OrtEngine
from compiler.shapes.buckets import AxisPolicy, BucketPlanner, symbolic_dim
from compiler.storage.store import KernelStore
from loadtest.bench_table import cpu_name
from tests.realmodels import DET, REC, rapidocr_model


def median_ms(engine, inputs: dict, runs: int) -> float:
    engine.run(inputs)
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        engine.run(inputs)
        times.append((time.perf_counter() - started) * 1000)
    return float(np.median(times))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["rec", "det"], default="rec")
    parser.add_argument("--widths", type=int, nargs="+", help="sizes (default rec 100 320 640, det 480 640 960)")
    parser.add_argument("--range", type=int, nargs=2, metavar=("MIN", "MAX"), help="default rec 48 800, det 480 960")
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    det = args.model == "det"
    low, high = args.range or ((480, 960) if det else (48, 800))
    sizes = args.widths or ([480, 640, 960] if det else [100, 320, 640])
    model = load_model_file(str(rapidocr_model(DET if det else REC)), max_bytes=1 << 30)
    target = resolve_target("llvm")
    dims = model.signature.inputs[0].dims
    step = 32 if det else 1
    axes = [dims[2], dims[3]] if det else [dims[3]]
    policy = AxisPolicy(kind="dynamic", min=low, max=high, step=step)
    planner = BucketPlanner(model.signature, dict.fromkeys(axes, policy))
    symbolic = [symbolic_dim(a, low, high, step) for a in axes]
    bucket = {"x": (1, 3, *symbolic) if det else (1, 3, 48, *symbolic)}

    def shape(size: int) -> tuple[int, ...]:
        return (1, 3, size, size) if det else (1, 3, 48, size)

    ort = OrtEngine(model.data)
    with tempfile.TemporaryDirectory() as directory:
        store = KernelStore(Path(directory))
        outcome = compile_bucket(model, bucket, target, store, verify_sizes=planner.verify_sizes(bucket))
        if not outcome.manifest.verified:
            raise SystemExit(f"the dynamic kernel failed verification: {outcome.manifest.verification}")
        dynamic = open_kernel(model, outcome, store)
        label = f"{args.model} {'HxW' if det else 'W'} {low}..{high}" + (f" in steps of {step}" if det else "")
        print(f"{cpu_name()}; dynamic kernel for {label}: {outcome.manifest.compile_seconds:.1f} s")
        print("| size | ORT ms | static ms | static compile s | dynamic ms | dynamic / static | dynamic / ORT |")
        print("|---|---|---|---|---|---|---|")
        for size in sizes:
            static_outcome = compile_bucket(model, {"x": shape(size)}, target, store)
            static = open_kernel(model, static_outcome, store)
            x = {"x": np.random.default_rng(size).standard_normal(shape(size), dtype=np.float32)}
            ort_ms, static_ms, dynamic_ms = (median_ms(e, x, args.runs) for e in (ort, static, dynamic))
            cells = [size, f"{ort_ms:.2f}", f"{static_ms:.2f}", f"{static_outcome.manifest.compile_seconds:.1f}"]
            cells += [f"{dynamic_ms:.2f}", f"**{dynamic_ms / static_ms:.2f}**", f"{dynamic_ms / ort_ms:.2f}"]
            print("| " + " | ".join(map(str, cells)) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
