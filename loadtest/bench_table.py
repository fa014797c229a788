"""The bench table of the project's notes: every goal model and bucket, one command.

    .venv/bin/python loadtest/bench_table.py [--tune-trials N] [--repeats R] [--out DIR]

Fetches the PP-OCR models (as the tests do), writes the BERT-style encoder of
``tests/synthetic.py``, runs ``python -m compiler bench`` once per model and
repeat (each in a fresh process, sharing one data dir: later repeats reuse the
kernels), and prints a Markdown table of the per-bucket medians over the
repeats. Raw JSON lines go to ``DIR/bench.jsonl``, the ratio plots to
``DIR/<model>.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.realmodels import CACHE, CLS, REC, rapidocr_model  # noqa: E402
from tests.synthetic import bert_encoder_model  # noqa: E402

BERT = "bert_encoder_l2_h256_s128.onnx"
MODELS = {
    "PP-OCR cls": (CLS, ["x=1,3,48,192", "x=8,3,48,192"]),
    "PP-OCRv4 rec": (REC, ["x=1,3,48,320", "x=8,3,48,320"]),
    "BERT encoder": (BERT, ["x=1,128,256", "x=8,128,256"]),
}


def model_path(file: str) -> Path:
    if file != BERT:
        return rapidocr_model(file)
    path = CACHE / BERT
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bert_encoder_model())
    return path


def bench(path: Path, shapes: list[str], args, plot: Path) -> list[dict]:
    command = [sys.executable, "-m", "compiler", "bench", str(path), "--runs", str(args.runs), "--plot", str(plot)]
    command += [arg for shape in shapes for arg in ("--shape", shape)]
    if args.tune_trials:
        command += ["--tune-trials", str(args.tune_trials)]
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
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    table = [
        "| model | bucket | ORT ms | TVM ms | TVM / ORT | tuned ms | tuned / ORT | compile s | tune s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    with (args.out / "bench.jsonl").open("a") as raw:
        for title, (file, shapes) in MODELS.items():
            path = model_path(file)
            runs: list[dict] = []
            for _ in range(args.repeats):
                rows = bench(path, shapes, args, args.out / f"{path.stem}.png")
                for row in rows:
                    raw.write(json.dumps({"model": title, **row}) + "\n")
                runs += rows
            for bucket in dict.fromkeys(r["bucket"] for r in runs):
                rows = [r for r in runs if r["bucket"] == bucket]
                ort, tvm, tuned = (_median(rows, k) for k in ("ort_ms", "tvm_ms", "tvm_tuned_ms"))
                cells = [title, bucket, f"{ort:.2f}", f"{tvm:.2f}", f"**{tvm / ort:.2f}**"]
                cells += [f"{tuned:.2f}", f"**{tuned / ort:.2f}**"] if tuned else ["", ""]
                cells += [f"{_median(rows, 'compile_seconds'):.1f}", f"{_median(rows, 'tune_seconds') or 0:.0f}"]
                table.append("| " + " | ".join(cells) + " |")
                print(table[-1], file=sys.stderr, flush=True)
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
