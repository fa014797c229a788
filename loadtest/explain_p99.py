"""p50/p99 of ``POST /predict`` while an explain profile runs on the server, against the same server idle
and while it compiles another model's bucket, in one run:

    .venv/bin/python loadtest/explain_p99.py MODEL.onnx --shape x=1,3,48,192 [--config CONFIG.json]

One closed-loop client sends the same request to one ready bucket. Phase ``profile`` counts only requests
answered while a profile (``POST .../explain/profile``) is in flight, phase ``compile`` only those answered
while a copy of the model compiles its bucket. Prints one JSON object per phase and the p99 ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_bucket_arguments, config_with_warm_bucket, parse_shapes, start_server, wait_warm


def _measure(client: httpx.Client, body: bytes, busy: threading.Event | None, requests: int) -> list[float]:
    """Latencies of requests answered while ``busy`` is set (all of them without one)."""
    latencies: list[float] = []
    deadline = time.monotonic() + 600
    while len(latencies) < requests and time.monotonic() < deadline:
        if busy is not None and not busy.is_set():
            time.sleep(0.005)
            continue
        started = time.perf_counter()
        client.post("/models/m/predict", content=body, headers={"content-type": "application/json"})
        if busy is None or busy.is_set():
            latencies.append((time.perf_counter() - started) * 1000)
    return latencies


def _in_background(work, busy: threading.Event, stop: threading.Event) -> threading.Thread:
    def loop() -> None:
        while not stop.is_set():
            busy.set()
            try:
                work()
            finally:
                busy.clear()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def _summary(phase: str, latencies: list[float]) -> dict:
    return {
        "phase": phase,
        "requests": len(latencies),
        "p50_ms": round(statistics.median(latencies), 3),
        "p99_ms": round(float(np.percentile(latencies, 99)), 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bucket_arguments(parser)
    args = parser.parse_args()
    shapes = parse_shapes(args.shape)
    rng = np.random.default_rng(0)
    body = json.dumps({"inputs": {n: rng.standard_normal(s).astype(np.float32).tolist() for n, s in shapes.items()}})
    config = config_with_warm_bucket(args.config, shapes)
    label = ",".join(f"{name}={'x'.join(map(str, shape))}" for name, shape in sorted(shapes.items()))
    model = args.model.read_bytes()
    results = []
    with tempfile.TemporaryDirectory() as data_dir:
        process, url = start_server(data_dir, tuning_enabled="false", routing="compiled")
        try:
            with httpx.Client(base_url=url, timeout=600) as client:
                files = {"model": ("m.onnx", model), "config": ("c.json", json.dumps(config))}
                client.put("/models/m", files=files).raise_for_status()
                wait_warm(url, ["m"])
                results.append(_summary("idle", _measure(client, body.encode(), None, args.requests)))

                busy, stop = threading.Event(), threading.Event()
                with httpx.Client(base_url=url, timeout=600) as admin:
                    path = f"/models/m/buckets/{label}/explain/profile"
                    thread = _in_background(lambda: admin.post(path, json={"runs": 10}), busy, stop)
                    results.append(_summary("profile", _measure(client, body.encode(), busy, args.requests)))
                    stop.set()
                    thread.join()

                    copies = iter(range(1_000_000))

                    def compile_copy() -> None:
                        # Another graph each time (a renamed output): a real compile, never a stored kernel.
                        name = f"c{next(copies)}"
                        files = {"model": ("m.onnx", _renamed(model, name)), "config": ("c.json", json.dumps(config))}
                        admin.put(f"/models/{name}", files=files).raise_for_status()
                        wait_warm(url, [name])

                    busy, stop = threading.Event(), threading.Event()
                    thread = _in_background(compile_copy, busy, stop)
                    results.append(_summary("compile", _measure(client, body.encode(), busy, args.requests)))
                    stop.set()
                    thread.join()
        finally:
            process.terminate()
            process.wait(60)
    for result in results:
        print(json.dumps(result), flush=True)
    idle, profiled, compiling = (r["p99_ms"] for r in results)
    print(json.dumps({"p99_profile_vs_idle": round(profiled / idle, 2),
                      "p99_profile_vs_compile": round(profiled / compiling, 2)}))  # fmt: skip
    return 0


def _renamed(model: bytes, suffix: str) -> bytes:
    import onnx

    loaded = onnx.load_from_string(model)
    loaded.graph.name = f"{loaded.graph.name}-{suffix}"
    identity = onnx.helper.make_node("Identity", [loaded.graph.output[0].name], [f"out_{suffix}"])
    loaded.graph.node.append(identity)
    loaded.graph.output[0].name = f"out_{suffix}"
    return loaded.SerializeToString()


if __name__ == "__main__":
    sys.exit(main())
