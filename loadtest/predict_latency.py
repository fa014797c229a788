"""Latency of ``POST /predict`` against calling ONNX Runtime directly.

Starts a real jitserve process per configuration on a free loopback port,
uploads the model, and times the same input through HTTP and through an
in-process ONNX Runtime session, in one run:

    .venv/bin/python loadtest/predict_latency.py MODEL.onnx --shape x=1,3,48,192 [--config CONFIG.json]

Configurations: ``ort-only`` (no compile workers: every request served by
ONNX Runtime, so the difference is the HTTP + JSON cost) and ``jit`` (the
bucket's verified TVM kernel serves once compiled). Prints one JSON object
per configuration. ``served_inference_p50_ms`` is the engine's share of each
request (the ``Server-Timing`` header: pad, run, cut back), compared with the
fastest engine routing measured for the bucket (``ratio_vs_fastest_engine``).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import config_with_warm_bucket, parse_shapes, start_server

from compiler.running.engines import OrtEngine


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def measure(model_path: Path, inputs: dict[str, np.ndarray], config: dict, runs: int, **settings) -> dict:
    data = model_path.read_bytes()
    # Encoded once: the client's JSON encoding is not the server's cost.
    body = json.dumps({"inputs": {k: v.tolist() for k, v in inputs.items()}}).encode()
    headers = {"content-type": "application/json"}
    with tempfile.TemporaryDirectory() as data_dir:
        process, url = start_server(data_dir, **settings)
        try:
            with httpx.Client(base_url=url, timeout=600) as client:
                files = {"model": ("m.onnx", data), "config": ("c.json", json.dumps(config))}
                client.put("/models/m", files=files).raise_for_status()
                client.post("/models/m/predict", content=body, headers=headers).raise_for_status()
                # Let the compile (if any) land and the warm bucket load.
                deadline = time.monotonic() + 600
                while time.monotonic() < deadline:
                    states = [b["state"] for b in client.get("/models/m").json()["buckets"]]
                    if all(s in ("ready", "failed", "cold") for s in states) and client.get("/readyz").is_success:
                        break
                    time.sleep(0.5)
                engine = OrtEngine(data)
                for _ in range(3):
                    client.post("/models/m/predict", content=body, headers=headers).raise_for_status()
                    engine.run(inputs)
                http_ms, ort_ms, inference_ms, engines = [], [], [], set()
                for _ in range(runs):
                    started = time.perf_counter()
                    response = client.post("/models/m/predict", content=body, headers=headers)
                    http_ms.append((time.perf_counter() - started) * 1000)
                    answer = response.json()
                    engines.add(answer["engine"])
                    inference_ms.append(float(response.headers["server-timing"].split("dur=")[1]))
                    started = time.perf_counter()
                    engine.run(inputs)
                    ort_ms.append((time.perf_counter() - started) * 1000)
                bucket = next(b for b in client.get("/models/m").json()["buckets"] if b["bucket"] == answer["bucket"])
        finally:
            process.terminate()
            process.wait(30)
    return {
        "served_by": sorted(engines),
        "predict_p50_ms": round(statistics.median(http_ms), 3),
        "predict_p99_ms": round(_percentile(http_ms, 99), 3),
        "ort_direct_p50_ms": round(statistics.median(ort_ms), 3),
        "ratio_p50_vs_ort": round(statistics.median(http_ms) / statistics.median(ort_ms), 2),
        "request_json_bytes": len(body),
        "served_inference_p50_ms": round(statistics.median(inference_ms), 3),
        "engine_latency_ms": bucket.get("latency_ms"),
        **_versus_fastest(statistics.median(inference_ms), bucket.get("latency_ms")),
    }


def _versus_fastest(served_ms: float, latency_ms: dict | None) -> dict:
    if not latency_ms:  # not routed (no compile workers): ONNX Runtime is the only engine
        return {}
    return {"ratio_vs_fastest_engine": round(served_ms / min(latency_ms.values()), 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("--shape", action="append", required=True, metavar="NAME=D0,D1,...")
    parser.add_argument("--config", type=Path, help="model config JSON (axis policies, probe sizes)")
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args()

    shapes = parse_shapes(args.shape)
    rng = np.random.default_rng(0)
    inputs = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    config = config_with_warm_bucket(args.config, shapes)

    for label, settings in (("ort-only", {"compile_workers": 0}), ("jit", {})):
        result = measure(args.model, inputs, config, args.runs, **settings)
        print(json.dumps({"config": label, "shape": args.shape, **result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
