"""Reduced precision against fp32 ONNX Runtime, in one process per model: ONNX Runtime fp32, OpenVINO
fp32 and OpenVINO in each reduced precision asked for, interleaved, each verified within a budget.

    .venv/bin/python loadtest/precision_bench.py [--models resnet50 vit_b_16 bert_base]
        [--precisions bf16] [--rounds 3] [--runs 20]

Takes the zoo's models (``make zoo``) at batch 1. Prints one Markdown row per model and round: the
milliseconds, each engine's ratio to ONNX Runtime in that round, and each reduced precision's error
against it. A precision the CPU lacks (bf16 without AMX or AVX512-BF16) is reported as refused.
Classifiers are judged by a cosine of 0.99 with the top class among ONNX Runtime's top 5, other
outputs by a cosine of 0.999 (``--budget`` overrides both).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import onnx  # noqa: E402

from compiler.running.engines import OrtEngine  # noqa: E402
from compiler.running.openvino_engine import OpenVinoEngine, missing_precision  # noqa: E402
from compiler.running.precision import AccuracyBudget, compare_within_budget  # noqa: E402
from loadtest.bench_table import cpu_name, cpuinfo_field  # noqa: E402
from loadtest.zoo import TRANSFORMERS, ZOO_MODELS, zoo_path  # noqa: E402

CLASSIFIER_BUDGET = {"cosine": 0.99, "top_k": 5}
OTHER_BUDGET = {"cosine": 0.999}


def inputs_for(data: bytes, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """Seeded inputs of the model's own types: token ids (and masks) below 1000, images normal."""
    graph = onnx.load_from_string(data).graph
    dtypes = {i.name: onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type) for i in graph.input}
    rng = np.random.default_rng(0)
    return {
        name: rng.integers(0, 1000, shape).astype(dtypes[name]) if np.issubdtype(dtypes[name], np.integer)
        else rng.standard_normal(shape).astype(dtypes[name])
        for name, shape in shapes.items()
    }  # fmt: skip


def run_ms(engine, feed: dict[str, np.ndarray]) -> float:
    started = time.perf_counter()
    engine.run(feed)
    return (time.perf_counter() - started) * 1000


def measure(name: str, precisions: list[str], rounds: int, runs: int, budget: dict | None) -> list[dict]:
    """Every round of one model: ms per engine, interleaved run by run."""
    data = zoo_path(name).read_bytes()
    shapes = ZOO_MODELS[name]
    feed = inputs_for(data, shapes)
    ort = OrtEngine(data, threads=2, spinning=False)  # spinning threads would hold the cores OpenVINO needs next
    want = ort.run(feed)
    bound = AccuracyBudget(**(budget or (OTHER_BUDGET if name in TRANSFORMERS else CLASSIFIER_BUDGET)))
    engines, errors = {"onnxruntime": ort}, {}
    with tempfile.TemporaryDirectory(dir=REPO / ".cache") as scratch:
        for precision in ["f32", *precisions]:
            if (missing := missing_precision(precision)) is not None:
                errors[precision] = f"refused: {missing}"
                continue
            engine = OpenVinoEngine(data, shapes, list(want), threads=2, ir_dir=Path(scratch) / precision,
                                    precision=precision)  # fmt: skip
            result = compare_within_budget(engine.run(feed), want, bound)
            errors[precision] = result.detail
            if result.matches:
                engines[engine.name] = engine
    for engine in engines.values():  # warm up
        engine.run(feed)
    results = []
    for _ in range(rounds):
        samples: dict[str, list[float]] = {label: [] for label in engines}
        for _ in range(runs):
            for label, engine in engines.items():
                samples[label].append(run_ms(engine, feed))
        ms = {label: statistics.median(values) for label, values in samples.items()}
        results.append({"model": name, "ms": ms, "errors": errors})
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["resnet50", "vit_b_16", "bert_base"])
    parser.add_argument("--precisions", nargs="+", default=["bf16"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--budget", type=json.loads, help="an accuracy budget, e.g. '{\"cosine\": 0.999}'")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child's model
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.precisions, args.rounds, args.runs, args.budget)))
        return 0
    flags = [f for f in ("avx512_bf16", "avx512_fp16", "amx_bf16") if f in cpuinfo_field("flags").split()]
    print(f"{cpu_name()} ({', '.join(flags) or 'no bf16 or fp16 hardware'}); batch 1, "
          f"median of {args.runs} interleaved runs per round\n")  # fmt: skip
    engines = ["openvino", *(f"openvino-{p}" for p in args.precisions)]
    print("| model | ORT fp32 ms | " + " | ".join(f"{e} / ORT" for e in engines) + " |")
    print("|---|---|" + "---|" * len(engines))
    details = []
    for name in args.models:
        if not zoo_path(name).is_file():
            raise SystemExit(f"{zoo_path(name)} is missing: `make zoo` exports the zoo's models")
        budget = ["--budget", json.dumps(args.budget)] if args.budget else []
        child = [sys.executable, __file__, "--one", name, "--rounds", str(args.rounds), "--runs", str(args.runs),
                 "--precisions", *args.precisions, *budget]  # fmt: skip
        rounds = json.loads(subprocess.run(child, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
        for row in rounds:
            ort = row["ms"]["onnxruntime"]
            cells = [f"**{row['ms'][e] / ort:.2f}**" if e in row["ms"] else "-" for e in engines]
            print(f"| {name} | {ort:.1f} | " + " | ".join(cells) + " |")
        details.append((name, rounds[0]["errors"]))
    print()
    for name, errors in details:
        for precision, detail in errors.items():
            print(f"- {name} {precision}: {detail}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
