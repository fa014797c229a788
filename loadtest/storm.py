"""A shape storm against compile admission, on PP-OCR rec (text width by the default policy, batch pow2 1..8).

    .venv/bin/python loadtest/storm.py [--requests 1000] [--storm-clients 1] [--out loadtest/results]
        [--no-cold-lane] [--compile-min-hits 3] [--compile-nice 10] [--compile-idle] [--replay 300]

Starts a real jitserve (fresh data dir), uploads PP-OCR rec with its hot shape
as a warm bucket, then measures the hot shape's latency alone (one client,
sequential), then again while storm clients send ``--requests`` requests of
random widths (the default policy gives the width, whose padding changes the
outputs, a symbolic kernel per 4x range; ``--exact-width`` makes every width a
bucket of its own, as before). Then it waits for the storm to pass (compile
admission defers compiles while it lasts), sends ``--replay`` storm widths to
earn the compiles, waits for them, and sends the same widths again, counting
the engines that answered.
Prints and writes ``storm.json``: the hot shape's p50/p99 before and during
the storm and their ratio, the storm's errors, distinct shapes and buckets,
compile admission's decisions, compiles admitted and run (during the storm and
in all), each bucket's route and latencies, the share of the replay served by
a compiled kernel, and the CPU it ran on. V2 binary tensors
keep the HTTP cost out of the way. ``--compile-min-hits 1`` admits compiles
during the storm (up to the budget), to measure what compile children at
``--compile-nice`` cost the hot shape; ``--no-cold-lane`` runs new shapes
beside established ones. The storm's clients are processes of their own at
niceness 19: on two cores a load generator at normal priority takes the cores
from the server it measures (real clients are elsewhere).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from loadtest.common import start_server, wait_warm  # noqa: E402
from loadtest.compare import cpu_line, v2_binary_body  # noqa: E402
from tests.realmodels import REC, real_model  # noqa: E402

HOT = (1, 3, 48, 320)
BATCH, HEIGHT, WIDTH = "p2o.DynamicDimension.0", "x:2", "p2o.DynamicDimension.1"
CONFIG = {
    "axes": {BATCH: {"kind": "pow2", "min": 1, "max": 8}},
    "probe_sizes": {BATCH: 1, HEIGHT: 48, WIDTH: 320},
    "warm_buckets": [{"x": list(HOT)}],
}


def infer(client: httpx.Client, shape: tuple[int, ...], rng: np.random.Generator) -> tuple[float, bool]:
    """One V2 binary infer: (milliseconds, failed)."""
    body, head = v2_binary_body("x", rng.random(shape, dtype=np.float32))
    headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(head)}
    started = time.perf_counter()
    response = client.post("/v2/models/rec/infer", content=body, headers=headers)
    return (time.perf_counter() - started) * 1000, response.status_code != 200


def hot_latencies(url: str, stop: threading.Event, out: list[float], seconds: float | None = None) -> None:
    rng = np.random.default_rng(0)
    deadline = time.monotonic() + seconds if seconds else None
    with httpx.Client(base_url=url, timeout=120) as client:
        while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
            ms, failed = infer(client, HOT, rng)
            assert not failed, "the hot shape failed"
            out.append(ms)


def storm(url: str, widths: list[int]) -> list[tuple[float, bool]]:
    rng = np.random.default_rng(len(widths))
    with httpx.Client(base_url=url, timeout=120) as client:
        return [infer(client, (1, 3, 48, width), rng) for width in widths]


def metrics(url: str) -> dict[tuple[str, ...], float]:
    from prometheus_client.parser import text_string_to_metric_families

    found = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name in ("jitserve_compile_admissions_total", "jitserve_compiles_total"):
                key = (sample.name, sample.labels.get("decision", ""), sample.labels.get("reason", ""))
            elif sample.name == "jitserve_requests_total":
                key = (sample.name, sample.labels.get("engine", ""), sample.labels.get("code", ""))
            else:
                continue
            found[key] = found.get(key, 0.0) + sample.value
    return found


def storm_over(url: str, timeout: float) -> float:
    """Wait until compile admission no longer sees a shape storm; the seconds it took."""
    started = time.monotonic()
    while time.monotonic() - started < timeout and httpx.get(f"{url}/models/rec").json()["compile_admission"]["storm"]:
        time.sleep(1)
    return time.monotonic() - started


def settle(url: str, timeout: float) -> None:
    """Wait until no bucket is admitted or compiling: the compiles the storm earned are done."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = {b["state"] for b in httpx.get(f"{url}/models/rec").json()["buckets"]}
        if not states & {"admitted", "compiling"}:
            return
        time.sleep(1)


def served_by(before: dict, after: dict) -> dict[str, int]:
    """Requests answered 200 per engine between two metric snapshots."""
    engines: dict[str, int] = {}
    for key, value in after.items():
        if key[0] == "jitserve_requests_total" and key[2] == "200":
            engines[key[1]] = engines.get(key[1], 0) + int(value - before.get(key, 0.0))
    return {engine: count for engine, count in engines.items() if count}


def percentile(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)), 2)


def run(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as data_dir:
        process, url = start_server(
            data_dir,
            tuning_enabled="false",
            compile_workers=1,
            kernel_threads=args.kernel_threads,
            cold_lane=str(args.cold_lane).lower(),
            compile_min_hits=args.compile_min_hits,
            compile_nice=args.compile_nice,
            compile_idle_priority=str(args.compile_idle).lower(),
        )
        try:
            config = (
                CONFIG if not args.exact_width else {**CONFIG, "axes": {**CONFIG["axes"], WIDTH: {"kind": "exact"}}}
            )
            files = {
                "model": ("rec.onnx", real_model(REC).read_bytes(), "application/octet-stream"),
                "config": ("config.json", json.dumps(config), "application/json"),
            }
            httpx.put(f"{url}/models/rec", files=files, timeout=600).raise_for_status()
            wait_warm(url, ["rec"], timeout=900)
            hot = httpx.get(f"{url}/models/rec").json()["buckets"][0]

            before: list[float] = []
            hot_latencies(url, threading.Event(), before, seconds=args.hot_seconds)
            compiles_before = sum(v for k, v in metrics(url).items() if k[0] == "jitserve_compiles_total")

            widths = np.random.default_rng(1).integers(48, 801, args.requests).tolist()
            shares = [widths[i :: args.storm_clients] for i in range(args.storm_clients)]
            during: list[float] = []
            stop = threading.Event()
            hot_thread = threading.Thread(target=hot_latencies, args=(url, stop, during))
            # Storm clients are processes of their own (here they would hold the GIL the hot client
            # needs), niced: the load generator must not take the cores of the server it measures.
            spawn = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(len(shares), mp_context=spawn, initializer=os.nice, initargs=(19,)) as clients:
                clients.submit(int).result()  # started before the clock
                started = time.monotonic()
                hot_thread.start()
                outcomes = [o for future in [clients.submit(storm, url, s) for s in shares] for o in future.result()]
                storm_seconds = time.monotonic() - started
            stop.set()
            hot_thread.join()

            after = metrics(url)
            described = httpx.get(f"{url}/models/rec").json()
            # What the storm earned: once it has passed (admission defers compiles during a storm), the
            # same traffic again, its compiles done, then the replay that is counted.
            storm_tail = storm_over(url, args.settle_seconds)
            storm(url, widths[: args.replay])
            settle(url, args.settle_seconds)
            before_replay = metrics(url)
            replay = storm(url, widths[: args.replay])
            replayed = metrics(url)
            settled = httpx.get(f"{url}/models/rec").json()
        finally:
            process.terminate()
            process.wait(60)

    decisions = {f"{k[1]}/{k[2]}": int(v) for k, v in sorted(after.items()) if k[0].endswith("admissions_total")}
    admitted = sum(v for k, v in decisions.items() if k.startswith("admitted/") and k != "admitted/warm")
    compiles = sum(v for k, v in after.items() if k[0] == "jitserve_compiles_total") - compiles_before
    compiles_all = sum(v for k, v in replayed.items() if k[0] == "jitserve_compiles_total") - compiles_before
    engines = served_by(before_replay, replayed)
    summary = {
        "cpu": cpu_line(),
        "hot_shape": "x".join(map(str, HOT)),
        "hot_engine": hot["engine"],
        "hot_p50_ms_before": percentile(before, 50),
        "hot_p99_ms_before": percentile(before, 99),
        "hot_p50_ms_during": percentile(during, 50),
        "hot_p99_ms_during": percentile(during, 99),
        "hot_p99_ratio": round(percentile(during, 99) / percentile(before, 99), 2),
        "hot_requests_before": len(before),
        "hot_requests_during": len(during),
        "storm_requests": len(outcomes),
        "storm_clients": args.storm_clients,
        "kernel_threads": args.kernel_threads,
        "cold_lane": args.cold_lane,
        "compile_min_hits": args.compile_min_hits,
        "compile_nice": args.compile_nice,
        "compile_idle_priority": args.compile_idle,
        "storm_seconds": round(storm_seconds, 1),
        "storm_errors": sum(failed for _, failed in outcomes),
        "storm_p50_ms": percentile([ms for ms, _ in outcomes], 50),
        "distinct_widths": len(set(widths)),
        "buckets": len(described["buckets"]),
        "compiles_admitted": admitted,
        "compiles_run_during_storm": int(compiles),
        "compiles_run_in_all": int(compiles_all),
        "storm_state_seconds_after": round(storm_tail, 1),
        "replay_requests": len(replay),
        "replay_errors": sum(failed for _, failed in replay),
        "replay_served_by": engines,
        "replay_compiled_share": round(1 - engines.get("onnxruntime", 0) / max(1, sum(engines.values())), 3),
        "buckets_after": [
            {k: b[k] for k in ("bucket", "state", "engine", "latency_ms", "compile_seconds", "hits")}
            for b in settled["buckets"]
        ],
        "admission_decisions": decisions,
        "compile_admission": described["compile_admission"],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "storm.json").write_text(json.dumps(summary, indent=2))
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000, help="storm requests, random widths 48..800")
    parser.add_argument("--storm-clients", type=int, default=1)
    parser.add_argument("--hot-seconds", type=float, default=20, help="the hot shape alone, before the storm")
    parser.add_argument(
        "--kernel-threads", type=int, default=0, help="threads per kernel call (0: every core; 1: no straggling)"
    )
    parser.add_argument(
        "--no-cold-lane", dest="cold_lane", action="store_false", help="new shapes run beside established ones"
    )
    parser.add_argument("--compile-min-hits", type=int, default=3, help="1: every new width earns a compile")
    parser.add_argument("--compile-nice", type=int, default=10, help="niceness of compile children")
    parser.add_argument("--compile-idle", action="store_true", help="compile children in the idle scheduling class")
    parser.add_argument("--replay", type=int, default=300, help="storm widths sent again once its compiles are done")
    parser.add_argument("--settle-seconds", type=float, default=600, help="longest wait for the storm's compiles")
    parser.add_argument("--exact-width", action="store_true", help="every width a bucket of its own (no dynamic tier)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    print(json.dumps(run(args), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
