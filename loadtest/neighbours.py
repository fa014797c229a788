"""Noisy neighbours: one model's latency alone and while another model takes a storm of clients, on one
jitserve (ONNX Runtime serving both, V2 binary tensors).

    .venv/bin/python loadtest/neighbours.py [--storm-clients 32] [--requests 300] [--out DIR]

The quiet model is PP-OCR cls at batch 1, asked by one sequential client; the storm is PP-OCR rec at batch 8
(about ten times cls's work a request), driven by ``wrk`` with ``--storm-clients`` connections at niceness 19
(on two cores a load generator at normal priority takes the cores from the server it measures). Prints a table
and a JSON line: the quiet model's p50 and p99 alone and under the storm, their ratio (the goal: p99 at most
2x), the storm's req/s and latency, and each model's wait for an inference thread from the server's
``jitserve_inference_queue_seconds``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loadtest.common import start_server  # noqa: E402
from loadtest.compare import cpu_line, v2_binary_body, wrk_script  # noqa: E402
from tests.realmodels import CLS, REC, real_model  # noqa: E402

QUIET = ("cls", CLS, (1, 3, 48, 192))
STORM = ("rec", REC, (8, 3, 48, 320))


def sequential(url: str, model: str, body: bytes, head: int, count: int) -> list[float]:
    """Milliseconds of ``count`` sequential V2 binary calls."""
    headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(head)}
    seconds = []
    with httpx.Client(base_url=url, timeout=60, verify=False) as client:
        for _ in range(count):
            started = time.perf_counter()
            client.post(f"/v2/models/{model}/infer", content=body, headers=headers).raise_for_status()
            seconds.append((time.perf_counter() - started) * 1e3)
    return seconds


def percentile(values: list[float], share: float) -> float:
    return sorted(values)[min(len(values) - 1, int(len(values) * share))]


def queue_waits(url: str) -> dict[str, float]:
    """Mean seconds each model's runs waited for an inference thread, from the server's metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    sums, counts = {}, {}
    for line in text.splitlines():
        for suffix, into in (("_sum", sums), ("_count", counts)):
            prefix = f'jitserve_inference_queue_seconds{suffix}{{model="'
            if line.startswith(prefix):
                model = line[len(prefix) :].split('"')[0]
                into[model] = float(line.rsplit(" ", 1)[1])
    return {model: round(sums[model] / counts[model] * 1e3, 3) for model in counts if counts[model]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--storm-clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=300, help="the quiet model's sequential calls per phase")
    parser.add_argument("--out", type=Path, default=REPO / "loadtest" / "results")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="neighbours-"))
    server, url = start_server(str(folder / "data"), compile_workers=0)
    bodies = {}
    try:
        for name, file, shape in (QUIET, STORM):
            files = {"model": ("model.onnx", real_model(file).read_bytes())}
            httpx.put(f"{url}/models/{name}", files=files, timeout=300, verify=False).raise_for_status()
            x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
            bodies[name] = v2_binary_body("x", x)
        quiet, storm = QUIET[0], STORM[0]
        sequential(url, storm, *bodies[storm], 5)
        sequential(url, quiet, *bodies[quiet], 20)  # warm: buckets seen, routes settled
        alone = sequential(url, quiet, *bodies[quiet], args.requests)
        body, head = bodies[storm]
        headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(head)}
        script = wrk_script(folder, "storm", body, headers)
        seconds = max(10, int(args.requests * percentile(alone, 0.5) / 1e3 * 4) + 5)
        wrk = subprocess.Popen(
            ["nice", "-n", "19", "wrk", "-t1", f"-c{args.storm_clients}", f"-d{seconds}s", "--latency",
             "-s", str(script), f"{url}/v2/models/{storm}/infer"],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        time.sleep(2)  # the storm's queue fills
        stormed = sequential(url, quiet, *bodies[quiet], args.requests)
        storm_out = wrk.communicate()[0]
        waits = queue_waits(url)
    finally:
        server.terminate()
        server.wait(30)
    rps = float(storm_out.split("Requests/sec:")[1].split()[0]) if "Requests/sec:" in storm_out else None
    result = {
        "cpu": cpu_line(),
        "quiet": f"{quiet} {QUIET[2]}",
        "storm": f"{storm} {STORM[2]}, {args.storm_clients} clients",
        "alone_p50_ms": round(percentile(alone, 0.5), 3),
        "alone_p99_ms": round(percentile(alone, 0.99), 3),
        "stormed_p50_ms": round(percentile(stormed, 0.5), 3),
        "stormed_p99_ms": round(percentile(stormed, 0.99), 3),
        "storm_rps": rps,
        "queue_wait_mean_ms": waits,
    }
    result["p99_ratio"] = round(result["stormed_p99_ms"] / result["alone_p99_ms"], 2)
    print(f"{result['cpu']}; {result['quiet']} alone and beside {result['storm']}\n")
    print("| quiet model | p50 ms | p99 ms |")
    print("| --- | --- | --- |")
    print(f"| alone | {result['alone_p50_ms']} | {result['alone_p99_ms']} |")
    stormed = f"{result['stormed_p99_ms']} (**{result['p99_ratio']}x**)"
    print(f"| beside the storm | {result['stormed_p50_ms']} | {stormed} |")
    print(f"\nstorm: {rps} req/s; mean wait for an inference thread (ms): {waits}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "neighbours.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
