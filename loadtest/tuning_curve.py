"""The tuning curve of one bucket: what each further minute of tuning buys, against the faster peer.

    .venv/bin/python loadtest/tuning_curve.py --model "zoo: mobilenet_v3_large" [--rounds 64:16 128:32 ...]

Runs ``python -m compiler bench --tune-trials N --tune-trials-per-task M`` once per round, each round a
fresh process on one store, so every round adds to the same tuning database as a server's background
tuner does (a task tuned before is not tuned again; a larger per-task allowance goes deeper into the
tasks already tuned). The first round is the server's default budget (64 trials, 16 a task). Each
round times ONNX Runtime, OpenVINO f32 (where enabled), the untuned kernel and the tuned one side by side,
so every point of the curve is a ratio measured in one process: the tuned kernel over the faster peer,
min(ONNX Runtime, OpenVINO f32), against the tuning minutes spent so far. Prints one JSON line a
round, then a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loadtest.bench_table import MODELS, BenchFailed, cpu_name, model_path, run_bench  # noqa: E402

DEFAULT_ROUNDS = ["64:16", "128:32", "256:64", "512:128"]


def round_budget(text: str) -> tuple[int, int]:
    trials, _, per_task = text.partition(":")
    return int(trials), int(per_task or 16)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, choices=list(MODELS), metavar="MODEL")
    parser.add_argument("--bucket", type=int, default=0, help="which of the model's bench buckets (0: the first)")
    parser.add_argument(
        "--rounds",
        nargs="+",
        default=[round_budget(r) for r in DEFAULT_ROUNDS],
        type=round_budget,
        metavar="TRIALS:PER_TASK",
    )
    parser.add_argument("--runs", type=int, default=10, help="timed runs per engine and round")
    parser.add_argument("--store", type=Path, help="the store to tune into (default: a fresh temporary one)")
    args = parser.parse_args()

    file, shapes, *_ = MODELS[args.model]
    bucket = shapes[args.bucket]
    store = args.store or Path(tempfile.mkdtemp(prefix="tuning-curve-"))
    print(f"{cpu_name()}; {args.model} {bucket}; store {store}", file=sys.stderr)
    spent = 0.0
    points = []
    for trials, per_task in args.rounds:
        options = ["--store", str(store), "--runs", str(args.runs)]
        options += ["--tune-trials", str(trials), "--tune-trials-per-task", str(per_task)]
        rows = run_bench(model_path(file), [bucket], options)
        if not rows:
            raise BenchFailed(f"no row for {bucket}")
        row = rows[0]
        spent += row.get("tune_seconds") or 0.0
        point = {
            "trials": trials,
            "per_task": per_task,
            "tuning_minutes": round(spent / 60, 1),
            **{key: row.get(key) for key in ("ort_ms", "openvino_ms", "peer_ms", "tvm_ms", "tvm_tuned_ms")},
            "untuned_vs_peer": row["ratio_vs_peer"].get("tvm"),
            "tuned_vs_peer": row["ratio_vs_peer"].get("tvm_tuned"),
            "tasks_improved": sum(1 for task in row.get("tune_plan") or [] if task.get("tuned_us")),
        }
        points.append(point)
        print(json.dumps(point), flush=True)
    print(f"\n{args.model} {bucket}: {cpu_name()}\n")
    print("| trials (per task) | tuning min, total | tasks confirmed faster | ORT ms | OpenVINO ms | untuned ms | "
          "tuned ms | untuned / peer | tuned / peer |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for p in points:
        print(
            f"| {p['trials']} ({p['per_task']}) | {p['tuning_minutes']} | {p['tasks_improved']} | {p['ort_ms']} | "
            f"{p['openvino_ms'] or ''} | {p['tvm_ms']} | {p['tvm_tuned_ms']} | {p['untuned_vs_peer']} | "
            f"**{p['tuned_vs_peer']}** |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
