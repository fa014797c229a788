"""Large JSON bodies against a real server: does one client's 15 MiB predict
hold up everyone else, and what do many of them cost in memory?

N clients each send large ``/predict`` bodies to a float32 ``x: [batch, 4]``
model (y = x + x) at once, repeatedly, while a prober calls ``/healthz`` every
20 ms. Prints the prober's latencies (p50, p99, max), the answers by status
and the server's peak RSS (sampled every 50 ms)::

    .venv/bin/python loadtest/big_bodies.py --clients 16 --mib 15.45
    .venv/bin/python loadtest/big_bodies.py --body-budget-mib 0 --parse-processes 0  # as before both
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest.common import start_server
from loadtest.compare import cpu_line
from tests import synthetic


def body(mib: float) -> bytes:
    rows = int(mib * 1024 * 1024 / 4 / 21)  # ~21 characters per float written by json
    x = np.random.default_rng(0).standard_normal((rows, 4)).astype(np.float32).tolist()
    return json.dumps({"inputs": {"x": x}}).encode()


def children_rss(process: psutil.Process) -> int:
    total = 0
    for child in process.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            total += child.memory_info().rss
    return total


def run(args: argparse.Namespace) -> dict:
    data = body(args.mib)
    settings = {"compile_workers": 0, "max_predict_bytes": len(data) + 1024}
    if args.body_budget_mib is not None:
        settings["max_body_bytes_in_flight"] = int(args.body_budget_mib * 1024 * 1024)
    if args.parse_processes is not None:
        settings["json_parse_processes"] = args.parse_processes
    with tempfile.TemporaryDirectory() as folder:
        process, url = start_server(folder, **settings)
        try:
            httpx.put(f"{url}/models/add", content=synthetic.add_model(), timeout=60).raise_for_status()
            server = psutil.Process(process.pid)
            stop = threading.Event()
            health: list[float] = []
            peak = [server.memory_info().rss]
            base_rss = peak[0]

            def probe() -> None:
                with httpx.Client(base_url=url, timeout=60) as client:
                    while not stop.is_set():
                        start = time.perf_counter()
                        client.get("/healthz").raise_for_status()
                        health.append((time.perf_counter() - start) * 1000)
                        time.sleep(0.02)

            def sample_rss() -> None:
                while not stop.is_set():
                    peak[0] = max(peak[0], server.memory_info().rss + children_rss(server))
                    time.sleep(0.05)

            def client_loop(_: int) -> collections.Counter:
                codes: collections.Counter = collections.Counter()
                with httpx.Client(base_url=url, timeout=300) as client:
                    for _ in range(args.rounds):
                        response = client.post(
                            "/models/add/predict", content=data, headers={"content-type": "application/json"}
                        )
                        codes[response.status_code] += 1
                return codes

            prober, sampler = threading.Thread(target=probe), threading.Thread(target=sample_rss)
            prober.start()
            sampler.start()
            start = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
                codes = sum(pool.map(client_loop, range(args.clients)), collections.Counter())
            seconds = time.perf_counter() - start
            stop.set()
            prober.join()
            sampler.join()
        finally:
            process.terminate()
            process.wait(30)
    health.sort()
    return {
        "cpu": cpu_line(),
        "body_mib": round(len(data) / 2**20, 2),
        "clients": args.clients,
        "rounds": args.rounds,
        "body_budget_mib": args.body_budget_mib,
        "parse_processes": args.parse_processes,
        "answers": dict(codes),
        "seconds": round(seconds, 1),
        "healthz_ms": {
            "p50": round(health[len(health) // 2], 1),
            "p99": round(health[int(len(health) * 0.99)], 1),
            "max": round(health[-1], 1),
            "count": len(health),
        },
        "rss_mb": {"before": round(base_rss / 1e6), "peak_with_children": round(peak[0] / 1e6)},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="predicts per client")
    parser.add_argument("--mib", type=float, default=15.45, help="size of each JSON body")
    parser.add_argument(
        "--body-budget-mib", type=float, default=None, help="JITSERVE_MAX_BODY_BYTES_IN_FLIGHT in MiB (0: none)"
    )
    parser.add_argument(
        "--parse-processes", type=int, default=None, help="JITSERVE_JSON_PARSE_PROCESSES (0: parsed on threads)"
    )
    print(json.dumps(run(parser.parse_args()), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
