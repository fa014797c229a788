"""The bench table of the project's notes: every goal model and bucket, one command.

    .venv/bin/python loadtest/bench_table.py [--tune-trials N] [--repeats R] [--out DIR]

Fetches the PP-OCR models and the YOLOv8n detector (as the tests do), writes
the BERT-style encoders of ``tests/synthetic.py`` (2 layers of hidden 256, and
BERT-base's 12 layers of hidden 768), takes the zoo's convnets that
``loadtest/zoo.py`` exported (``make zoo``), runs ``python -m compiler bench`` once per model and repeat (each
in a fresh process, sharing one data dir: later repeats reuse the kernels), and
prints a Markdown table of the per-bucket medians over the repeats, with each
engine's GFLOP/s (the contractions' FLOPs, :mod:`compiler.measuring.flops`) and, as the
machine's reference peaks, numpy SGEMMs of 2048^3 measured at the start: one
with OpenBLAS's kernels for the host's ISA and one with its AVX2 kernels,
so kernels built for AVX2 on an AVX-512 machine are judged against what AVX2
can reach there. OpenVINO, where it is installed and enabled (``JITSERVE_OPENVINO``), is built, verified
and timed in the same processes: its columns stay empty where it did not verify. The "/ peer" columns
divide by the faster peer, min(ONNX Runtime, OpenVINO f32) on the bucket: the engine a kernel must beat
to serve.
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

from compiler.measuring.flops import model_flops  # noqa: E402
from loadtest.zoo import ARCHITECTURES, QUANTIZED, TRANSFORMERS, quantized, zoo_path  # noqa: E402
from tests.realmodels import CACHE, CLS, DET, DETECTOR, REC, real_model  # noqa: E402
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
    "YOLOv8n (nudenet 320n)": (DETECTOR, ["images=1,3,320,320", "images=8,3,320,320"]),
    **{f"zoo: {name}": (f"zoo:{name}", ["x=1,3,224,224", "x=8,3,224,224"]) for name in sorted(ARCHITECTURES)},
    "zoo: vit_b_16": ("zoo:vit_b_16", ["x=1,3,224,224", "x=8,3,224,224"]),
    "zoo: gpt2": ("zoo:gpt2", ["input_ids=1,128", "input_ids=1,512"]),
    "zoo: bert_base": (
        "zoo:bert_base",
        ["input_ids=1,128;attention_mask=1,128", "input_ids=8,128;attention_mask=8,128"],
    ),
    "zoo: whisper_tiny_encoder": ("zoo:whisper_tiny_encoder", ["input_features=1,80,3000"]),
    # Quantized (loadtest/zoo.py's QUANTIZED), each judged by the int8 budget its owner would give: every
    # engine's QDQ ResNet-50 logits are at cosine 0.98 to ONNX Runtime's int8 ones, and to each other.
    "zoo: resnet50 int8 (QDQ)": ("zoo:resnet50_int8_qdq", ["x=1,3,224,224", "x=8,3,224,224"], ["--cosine", "0.97"]),
    "zoo: bert_base int8 (dynamic)": (
        "zoo:bert_base_int8_dynamic",
        ["input_ids=1,128;attention_mask=1,128", "input_ids=8,128;attention_mask=8,128"],
        ["--cosine", "0.99"],
    ),
    "zoo: bert_base int8 (QDQ)": (
        "zoo:bert_base_int8_qdq",
        ["input_ids=1,128;attention_mask=1,128", "input_ids=8,128;attention_mask=8,128"],
        ["--cosine", "0.99"],
    ),
}
assert {f"zoo: {name}" for name in TRANSFORMERS} <= set(MODELS)


def model_path(file: str) -> Path:
    if file.startswith("zoo:") and file.removeprefix("zoo:") in QUANTIZED:
        source = zoo_path(QUANTIZED[file.removeprefix("zoo:")][0])
        if not source.is_file():
            raise SystemExit(f"{source} is missing: `make zoo` exports the zoo's models")
        return quantized(file.removeprefix("zoo:"))
    if file.startswith("zoo:"):
        path = zoo_path(file.removeprefix("zoo:"))
        if not path.is_file():
            raise SystemExit(f"{path} is missing: `make zoo` exports the zoo's models")
        return path
    if file not in ENCODERS:
        return real_model(file)
    path = CACHE / file
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(bert_encoder_model(**ENCODERS[file]))
        tmp.replace(path)
    return path


def sgemm_gflops(size: int = 2048, repeats: int = 5) -> float:
    """The machine's reference peak: the best of ``repeats`` numpy SGEMMs of ``size``^3.

    OpenBLAS picks its kernels when it loads, so ``OPENBLAS_CORETYPE`` set
    before the process starts (see :func:`isa_sgemm_gflops`) chooses the ISA.
    """
    a = np.random.default_rng(0).standard_normal((size, size), dtype=np.float32)
    b = np.random.default_rng(1).standard_normal((size, size), dtype=np.float32)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best / 1e9


# OpenBLAS's kernels per vector ISA. Left to itself, OpenBLAS runs its AVX2 (Haswell) kernels on
# AMD Zen 4 and 5: 260 GFLOP/s against 470 with its AVX-512 ones (AMD EPYC Zen 5, 2 cores).
OPENBLAS_CORES = {"AVX-512": "SkylakeX", "AVX2": "Haswell"}


def isa_sgemm_gflops(isa: str) -> float:
    """The SGEMM peak with OpenBLAS's kernels for ``isa``, in a child process (they are picked at load)."""
    code = "import sys; sys.path.insert(0, 'loadtest'); from bench_table import sgemm_gflops; print(sgemm_gflops())"
    env = dict(os.environ, OPENBLAS_CORETYPE=OPENBLAS_CORES[isa])
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    return float(done.stdout.split()[-1])


def target_vector_bits(target: str) -> int:
    """The vector width the compiler plans for ``target`` (a JSON target dict)."""
    import tvm

    from compiler.tvm.schedules.base import vector_unit

    return vector_unit(tvm.target.Target(json.loads(target))).bits


def cpuinfo_field(field: str) -> str:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith(field)), "")


def host_isa() -> str:
    """The host's widest vector ISA."""
    flags = cpuinfo_field("flags").split()
    return "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "SSE"


def cpu_name() -> str:
    """The CPU's model name and its widest vector ISA, as every figure must state them."""
    return f"{cpuinfo_field('model name') or '?'}, {host_isa()}, {len(os.sched_getaffinity(0))} cores"


def bucket_shapes(bucket: str) -> dict[str, tuple[int, ...]]:
    """A bucket of the table, ``x=1,3,224,224`` or, for several inputs, ``ids=1,128;mask=1,128``."""
    shapes = {}
    for arg in bucket.split(";"):
        name, dims = arg.split("=")
        shapes[name] = tuple(int(d) for d in dims.split(","))
    return shapes


def bucket_flops(path: Path, buckets: list[str]) -> dict[str, float]:
    """GFLOPs per bucket label (as bench prints it, ``x=1x3x48x192``)."""
    model = onnx.load(str(path))
    result = {}
    for bucket in buckets:
        shapes = bucket_shapes(bucket)
        flops, unknown = model_flops(model, shapes)
        if unknown:  # shapes only onnxsim's folding makes known
            import onnxsim

            simplified, ok = onnxsim.simplify(model, overwrite_input_shapes={n: list(s) for n, s in shapes.items()})
            if ok:
                flops, _ = model_flops(simplified, shapes)
        result[",".join(f"{n}={'x'.join(map(str, s))}" for n, s in sorted(shapes.items()))] = flops / 1e9
    return result


def bench(path: Path, shapes: list[str], args, plot: Path, extra: list[str] = ()) -> list[dict]:
    options = ["--runs", str(args.runs), "--plot", str(plot), *extra]
    if args.tune_trials:
        options += ["--tune-trials", str(args.tune_trials)]
    if args.target:
        options += ["--target", args.target]
    return run_bench(path, shapes, options, env={"JITSERVE_DATA_DIR": str(args.out / "data")})


def run_bench(path: Path, buckets: list[str], options: list[str], env: dict | None = None) -> list[dict]:
    """``python -m compiler bench`` on ``buckets`` (``a=1,2;b=3``) in a process of its own: its rows."""
    command = [sys.executable, "-m", "compiler", "bench", str(path), *options]
    command += [arg for bucket in buckets for shape in bucket.split(";") for arg in ("--shape", shape)]
    done = subprocess.run(
        command, check=False, cwd=REPO, env={**os.environ, **(env or {})}, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise BenchFailed(" ".join(done.stderr.strip().splitlines()[-1:]) or f"exit status {done.returncode}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


class BenchFailed(Exception):
    """``python -m compiler bench`` failed on a model: its row says why, and the table goes on."""


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
    isa = host_isa()
    host_peak = isa_sgemm_gflops(isa) if isa in OPENBLAS_CORES else sgemm_gflops()
    avx2_peak = isa_sgemm_gflops("AVX2") if isa == "AVX-512" else host_peak
    print(
        f"{cpu_name()}; numpy SGEMM 2048^3: {host_peak:.1f} GFLOP/s with {isa} kernels, "
        f"{avx2_peak:.1f} with AVX2 kernels; target: {args.target or 'host'}"
    )
    # ONNX Runtime always runs the host's kernels; TVM's are judged against their own ISA's peak.
    tvm_peak = avx2_peak if args.target and target_vector_bits(args.target) == 256 else host_peak
    table = [
        "| model | bucket | TVM precision | GFLOP | ORT ms | ORT GFLOP/s | ORT % peak | TVM ms | TVM GFLOP/s "
        "| TVM % peak | TVM / ORT | tuned ms | tuned / ORT | OpenVINO ms | OpenVINO / ORT | TVM / peer | tuned / peer "
        "| compile s | tune s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    with (args.out / "bench.jsonl").open("a") as raw:
        for title in args.models:
            file, shapes, *extra = MODELS[title]
            path = model_path(file)
            flops = bucket_flops(path, shapes)
            runs: list[dict] = []
            for _ in range(args.repeats):
                try:
                    rows = bench(path, shapes, args, args.out / f"{path.stem}.png", *extra)
                except BenchFailed as exc:
                    table.append(f"| {title} | | bench failed: {exc} |")
                    print(table[-1], file=sys.stderr, flush=True)
                    break
                for row in rows:
                    raw.write(json.dumps({"model": title, **row}) + "\n")
                runs += rows
            for bucket in dict.fromkeys(r["bucket"] for r in runs):
                rows = [r for r in runs if r["bucket"] == bucket]
                ort, tvm, tuned = (_median(rows, k) for k in ("ort_ms", "tvm_ms", "tvm_tuned_ms"))
                gflop = flops.get(bucket, 0.0)
                ort_rate, tvm_rate = gflop / ort * 1000, gflop / tvm * 1000
                precision = rows[0].get("precision", {}).get("tvm", "fp32")  # int8 (avx2), or why not
                cells = [
                    title,
                    bucket,
                    precision,
                    f"{gflop:.2f}",
                    f"{ort:.2f}",
                    f"{ort_rate:.1f}",
                    f"{ort_rate / host_peak:.0%}",
                ]
                cells += [f"{tvm:.2f}", f"{tvm_rate:.1f}", f"{tvm_rate / tvm_peak:.0%}", f"**{tvm / ort:.2f}**"]
                cells += [f"{tuned:.2f}", f"**{tuned / ort:.2f}**"] if tuned else ["", ""]
                openvino = _median(rows, "openvino_ms")  # absent where not installed, disabled or not verified
                cells += [f"{openvino:.2f}", f"**{openvino / ort:.2f}**"] if openvino else ["", ""]
                peer = min(ort, openvino or ort)  # the faster peer: the engine a kernel must beat to serve
                cells += [f"**{tvm / peer:.2f}**", f"**{tuned / peer:.2f}**" if tuned else ""]
                cells += [f"{_median(rows, 'compile_seconds'):.1f}", f"{_median(rows, 'tune_seconds') or 0:.0f}"]
                table.append("| " + " | ".join(cells) + " |")
                print(table[-1], file=sys.stderr, flush=True)
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
