"""Regenerate the shipped tuning database for this machine's vector ISA and core count.

    make tune-db                                    # every model of the bench table
    .venv/bin/python loadtest/tune_db.py [--models "zoo: shufflenet_v2_x1_0" ...] [--trials 64]

Tunes each bucket of the bench table (``loadtest/bench_table.py``; ``make zoo`` exports the zoo) with
``python -m compiler bench --tune-trials N``, one process per model, all sharing one tuning database
under ``.cache/tune-db/<isa>``: a task two models share is tuned once. Then writes the records
tuning improved (a confirmed winner over the rules' default schedule) to
``compiler/tuning_db/<isa>.json.gz``, with their provenance: the CPU, its ISA and cores, the date, the
trials and the buckets. A model's records are kept only where its tuned kernel ran faster than its untuned
one in the model, side by side in the same process (by ``MIN_MODEL_GAIN``), in the run that tuned it and
again in ``--confirmations`` fresh processes that re-time the stored kernels: a kernel confirmed faster
alone, cold, may still slow the model it runs in, and one process's pair was not enough (SqueezeNet's and
PP-OCR cls's records passed it on a busy machine, then ran slower in alternating processes on a quiet one).
A compile on a machine of the same ISA and core count
applies them at its first compile; other machines ignore them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loadtest.bench_table import MODELS, BenchFailed, cpu_name, model_path, run_bench  # noqa: E402

SHOWN = ("bucket", "ort_ms", "openvino_ms", "tvm_ms", "tvm_tuned_ms", "ratio_vs_peer", "tune_seconds", "tune_trials")
"""A bench row's facts printed per run."""
MIN_MODEL_GAIN = 0.03
"""A model's tuned kernel must run this much faster than its untuned one for its records to ship."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # The quantized models (judged by a budget, not fp32's tolerances) are not tuned into the shipped records.
    fp32 = [title for title, entry in MODELS.items() if len(entry) == 2]
    parser.add_argument("--models", nargs="*", default=fp32, choices=list(MODELS), metavar="MODEL")
    parser.add_argument("--trials", type=int, default=64, help="tuning trials per bucket")
    parser.add_argument("--trials-per-task", type=int, default=16)
    parser.add_argument("--buckets", type=int, default=1, help="the first N buckets of each model")
    parser.add_argument(
        "--confirmations", type=int, default=2, help="fresh processes that must each time the model faster tuned"
    )
    args = parser.parse_args()

    import tvm

    from compiler.building.target import resolve_target
    from compiler.tvm.tuning_database import SHIPPED_DIR, improved_workloads, isa_key, shipped_path, write_shipped

    target = tvm.target.Target(resolve_target("llvm"))
    key = isa_key(target)
    if key is None:
        raise SystemExit(f"no shipped database for this target: {target}")
    store = REPO / ".cache" / "tune-db" / key
    tuned: list[str] = []
    kept: set[int] = set()
    started = time.time()
    for title in args.models:
        file, shapes, *_ = MODELS[title]
        path = model_path(file)
        buckets = shapes[: args.buckets]
        options = ["--store", str(store), "--runs", "5"]
        options += ["--tune-trials", str(args.trials), "--tune-trials-per-task", str(args.trials_per_task)]
        before = improved_workloads(str(store / "tuning"))
        runs = []  # the first run tunes; the others re-time the kernels it stored, each in a fresh process
        try:
            for _ in range(1 + args.confirmations):
                runs.append(run_bench(path, buckets, options))
        except BenchFailed as exc:
            print(f"{title}: {exc}", file=sys.stderr, flush=True)
        faster = len(runs) == 1 + args.confirmations and all(rows and all(
            row.get("tvm_tuned_ms") and row["tvm_tuned_ms"] < row["tvm_ms"] * (1 - MIN_MODEL_GAIN) for row in rows
        ) for rows in runs)  # fmt: skip
        added = {key for key, trace in improved_workloads(str(store / "tuning")).items() if before.get(key) != trace}
        if faster:
            kept |= added
            tuned += [f"{title} {bucket}" for bucket in buckets]
        for number, rows in enumerate(runs):
            for row in rows:
                facts = {k: row.get(k) for k in SHOWN}
                print(json.dumps({"model": title, "run": number, "records_kept": len(added) if faster else 0, **facts}))
    provenance = {
        "cpu": cpu_name(),
        "target": str(target),
        "made": time.strftime("%Y-%m-%d", time.gmtime()),
        "trials_per_bucket": args.trials,
        "trials_per_task": args.trials_per_task,
        "hours": round((time.time() - started) / 3600, 2),
        "buckets": tuned,
    }
    written = write_shipped(str(store / "tuning"), target, shipped_path(SHIPPED_DIR, key), provenance, keep=kept)
    print(f"{written} records for {key} -> {shipped_path(SHIPPED_DIR, key).relative_to(REPO)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
