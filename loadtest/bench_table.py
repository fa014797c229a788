"""The bench table of the project's notes: every goal model and bucket, one command.

    .venv/bin/python loadtest/bench_table.py [--tune-trials N] [--repeats R] [--out DIR]

Fetches the PP-OCR models (as the tests do), writes the BERT-style encoders of
``tests/synthetic.py`` (2 layers of hidden 256, and BERT-base's 12 layers of
hidden 768), runs ``python -m compiler bench`` once per model and repeat (each
in a fresh process, sharing one data dir: later repeats reuse the kernels), and
prints a Markdown table of the per-bucket medians over the repeats, with each
engine's GFLOP/s (the contractions' FLOPs, :mod:`compiler.flops`) and, as the
machine's reference peak, a numpy SGEMM of 2048^3 measured at the start.
``--target`` compiles for another CPU than the host's (an AVX2 ``mcpu`` on an
AVX-512 machine: ONNX Runtime still runs its AVX-512 kernels there, so its
ratio is not the AVX2 machine's). Raw JSON lines go to ``DIR/bench.jsonl``,
the ratio plots to ``DIR/<model>.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import onnx  # noqa: E402

from compiler.flops import model_flops  # noqa: E402
from tests.realmodels import CACHE, CLS, DET, REC, rapidocr_model  # noqa: E402
from tests.synthetic import bert_encoder_model  # noqa: E402

# Synthetic encoders: file name -> bert_encoder_model's arguments.
ENCODERS = {
    "bert_encoder_l2_h256_s128.onnx": {},
    "bert_encoder_l12_h768_s128.onnx": {"layers": 12, "hidden": 768, "heads": 12},
}
MODELS = {
    "PP-OCR cls": (CLS, ["x=1,3,48,192", "x=8,3,48,192"]),
    "PP-OCRv4 rec": (REC, ["x=1,3,48,320", "x=8,3,48,320"]),
    "PP-OCRv4 det": (DET, ["x=1,3,640,640", "x=8,3,640,640"]),
    "BERT encoder": ("bert_encoder_l2_h256_s128.onnx", ["x=1,128,256", "x=8,128,256"]),
    "BERT-base encoder": ("bert_encoder_l12_h768_s128.onnx", ["x=1,128,768", "x=8,128,768"]),
}


def model_path(file: str) -> Path:
    if file not in ENCODERS:
        return rapidocr_model(file)
    path = CACHE / file
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(bert_encoder_model(**ENCODERS[file]))
        tmp.replace(path)
    return path


def sgemm_gflops(size: int = 2048, repeats: int = 5) -> float:
    """The machine's reference peak: the best of ``repeats`` numpy SGEMMs of ``size``^3."""
    a = np.random.default_rng(0).standard_normal((size, size), dtype=np.float32)
    b = np.random.default_rng(1).standard_normal((size, size), dtype=np.float32)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best / 1e9


def cpu_name() -> str:
    """The CPU's model name and its widest vector ISA, as every figure must state them."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "SSE"
    return f"{model}, {isa}, {len(os.sched_getaffinity(0))} cores"


def bucket_flops(path: Path, shape_args: list[str]) -> dict[str, float]:
    """GFLOPs per bucket label (as bench prints it, ``x=1x3x48x192``)."""
    model = onnx.load(str(path))
    result = {}
    for arg in shape_args:
        name, dims = arg.split("=")
        sizes = tuple(int(d) for d in dims.split(","))
        flops, unknown = model_flops(model, {name: sizes})
        if unknown:  # shapes only onnxsim's folding makes known
            import onnxsim

            simplified, ok = onnxsim.simplify(model, overwrite_input_shapes={name: list(sizes)})
            if ok:
                flops, _ = model_flops(simplified, {name: sizes})
        result[f"{name}={'x'.join(map(str, sizes))}"] = flops / 1e9
    return result


def bench(path: Path, shapes: list[str], args, plot: Path) -> list[dict]:
    command = [sys.executable, "-m", "compiler", "bench", str(path), "--runs", str(args.runs), "--plot", str(plot)]
    command += [arg for shape in shapes for arg in ("--shape", shape)]
    if args.tune_trials:
        command += ["--tune-trials", str(args.tune_trials)]
    if args.target:
        command += ["--target", args.target]
    env = dict(os.environ, JITSERVE_DATA_DIR=str(args.out / "data"))
    done = subprocess.run(command, check=False, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"bench failed: {done.stderr.strip().splitlines()[-1:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def _median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tune-trials", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--out", type=Path, default=REPO / "loadtest" / "results" / "bench")
    parser.add_argument("--target", default=None, help="a JSON target dict (default: the host CPU)")
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS), metavar="MODEL")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    peak = sgemm_gflops()
    print(f"{cpu_name()}; numpy SGEMM 2048^3: {peak:.1f} GFLOP/s; target: {args.target or 'host'}")
    table = [
        "| model | bucket | GFLOP | ORT ms | ORT GFLOP/s | TVM ms | TVM GFLOP/s | TVM / ORT "
        "| tuned ms | tuned / ORT | compile s | tune s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    with (args.out / "bench.jsonl").open("a") as raw:
        for title in args.models:
            file, shapes = MODELS[title]
            path = model_path(file)
            flops = bucket_flops(path, shapes)
            runs: list[dict] = []
            for _ in range(args.repeats):
                rows = bench(path, shapes, args, args.out / f"{path.stem}.png")
                for row in rows:
                    raw.write(json.dumps({"model": title, **row}) + "\n")
                runs += rows
            for bucket in dict.fromkeys(r["bucket"] for r in runs):
                rows = [r for r in runs if r["bucket"] == bucket]
                ort, tvm, tuned = (_median(rows, k) for k in ("ort_ms", "tvm_ms", "tvm_tuned_ms"))
                gflop = flops.get(bucket, 0.0)
                cells = [title, bucket, f"{gflop:.2f}", f"{ort:.2f}", f"{gflop / ort * 1000:.1f}"]
                cells += [f"{tvm:.2f}", f"{gflop / tvm * 1000:.1f}", f"**{tvm / ort:.2f}**"]
                cells += [f"{tuned:.2f}", f"**{tuned / ort:.2f}**"] if tuned else ["", ""]
                cells += [f"{_median(rows, 'compile_seconds'):.1f}", f"{_median(rows, 'tune_seconds') or 0:.0f}"]
                table.append("| " + " | ".join(cells) + " |")
                print(table[-1], file=sys.stderr, flush=True)
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
