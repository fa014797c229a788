"""p50/p99 of ``POST /predict`` while background tuning runs, against the same
server with tuning off, in one run:

    .venv/bin/python loadtest/tuning_p99.py MODEL.onnx --shape x=1,3,48,192 [--config CONFIG.json]

Both phases send the same closed-loop requests from one client to one
bucket. Phase ``tuning`` measures only while the bucket's tuning is running.
Prints one JSON object per phase and their p99 ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_bucket_arguments, config_with_warm_bucket, parse_shapes, start_server, wait_warm


def _bucket(client: httpx.Client) -> dict:
    buckets = client.get("/models/m").json()["buckets"]
    return buckets[0] if buckets else {}


def phase(model: Path, body: bytes, config: dict, *, tuning: bool, requests: int, trials: int) -> dict:
    settings = {"tuning_enabled": str(tuning).lower(), "routing": "compiled"}
    if tuning:
        settings |= {"tune_min_hits": 10, "tuning_interval_seconds": 1, "tune_trials_per_bucket": trials}
    headers = {"content-type": "application/json"}
    with tempfile.TemporaryDirectory() as data_dir:
        process, url = start_server(data_dir, **settings)
        try:
            with httpx.Client(base_url=url, timeout=600) as client:
                files = {"model": ("m.onnx", model.read_bytes()), "config": ("c.json", json.dumps(config))}
                client.put("/models/m", files=files).raise_for_status()
                wait_warm(url, ["m"])
                latencies: list[float] = []
                deadline = time.monotonic() + 900
                while len(latencies) < requests and time.monotonic() < deadline:
                    started = time.perf_counter()
                    client.post("/models/m/predict", content=body, headers=headers).raise_for_status()
                    elapsed = (time.perf_counter() - started) * 1000
                    # With tuning on, count only requests served while the tuner is at work.
                    if not tuning or (_bucket(client).get("tuning") or {}).get("state") == "tuning":
                        latencies.append(elapsed)
                tuning_state = _bucket(client).get("tuning")
        finally:
            process.terminate()
            process.wait(60)
    return {
        "phase": "tuning" if tuning else "no-tuning",
        "requests": len(latencies),
        "p50_ms": round(statistics.median(latencies), 3),
        "p99_ms": round(float(np.percentile(latencies, 99)), 3),
        "tuning": tuning_state,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bucket_arguments(parser)
    parser.add_argument("--trials", type=int, default=64)
    args = parser.parse_args()
    shapes = parse_shapes(args.shape)
    rng = np.random.default_rng(0)
    inputs = {name: rng.standard_normal(shape).astype(np.float32).tolist() for name, shape in shapes.items()}
    body = json.dumps({"inputs": inputs}).encode()
    config = config_with_warm_bucket(args.config, shapes)

    results = [
        phase(args.model, body, config, tuning=tuning, requests=args.requests, trials=args.trials)
        for tuning in (False, True)
    ]
    for result in results:
        print(json.dumps(result), flush=True)
    print(json.dumps({"p99_ratio_tuning_vs_not": round(results[1]["p99_ms"] / results[0]["p99_ms"], 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
