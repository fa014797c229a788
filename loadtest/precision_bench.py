"""Reduced precision against fp32 ONNX Runtime, in one process per model: ONNX Runtime fp32, OpenVINO
fp32 and OpenVINO in each reduced precision asked for, timed in turn, each verified within a budget.

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
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from compiler.measuring.timing import median_latencies_ms  # noqa: E402
from compiler.models.model import load_model  # noqa: E402
from compiler.running.arrays import random_inputs  # noqa: E402
from compiler.running.engines import OrtEngine  # noqa: E402
from compiler.running.openvino_engine import OpenVinoEngine, missing_precision  # noqa: E402
from compiler.running.precision import AccuracyBudget, compare_within_budget  # noqa: E402
from loadtest.bench_table import cpu_name, cpuinfo_field  # noqa: E402
from loadtest.zoo import TRANSFORMERS, ZOO_MODELS, zoo_path  # noqa: E402

CLASSIFIER_BUDGET = {"cosine": 0.99, "top_k": 5}
OTHER_BUDGET = {"cosine": 0.999}


def measure(name: str, precisions: list[str], rounds: int, runs: int, budget: dict | None) -> list[dict]:
    """Every round of one model: ms per engine, the engines timed in turn (blocks of 5 runs)."""
    data = zoo_path(name).read_bytes()
    shapes = ZOO_MODELS[name]
    model = load_model(data, max_bytes=len(data))
    dtypes = {spec.name: spec.dtype for spec in model.signature.inputs}
    feed = random_inputs(shapes, dtypes, 0, model.index_bounds.limits)
    ort = OrtEngine(data, threads=2, spinning=False)  # spinning threads would hold the cores OpenVINO needs next
    want = ort.run(feed)
    bound = AccuracyBudget(**(budget or (OTHER_BUDGET if name in TRANSFORMERS else CLASSIFIER_BUDGET)))
    engines, errors = {"onnxruntime": ort}, {}
    with tempfile.TemporaryDirectory(dir=REPO / ".cache") as scratch:
        for precision in ["f32", *precisions]:
            if (missing := missing_precision(precision)) is not None:
                errors[precision] = f"refused: {missing}"
                continue
            engine = OpenVinoEngine.static(data, shapes, list(want), threads=2, ir_dir=Path(scratch) / precision,
                                    precision=precision)  # fmt: skip
            result = compare_within_budget(engine.run(feed), want, bound)
            errors[precision] = result.detail
            if result.matches:
                engines[engine.name] = engine
    return [
        {"model": name, "ms": median_latencies_ms(engines, feed, runs=runs), "errors": errors} for _ in range(rounds)
    ]


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
          f"median of {args.runs} runs per round, engines in turn\n")  # fmt: skip
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
