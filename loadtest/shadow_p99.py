"""What shadow verification costs served requests: p50/p99 and req/s of ``POST /models/m/predict`` on a
kernel-served bucket with shadow checks at the default rate against the same server with them off, in one
run:

    .venv/bin/python loadtest/shadow_p99.py [--model cls] [--connections 8] [--duration 10] [--rounds 3]

Two jitserve processes (``routing=compiled``, so the bucket's kernel serves every request; one with
``shadow_rate`` at its default, one with 0) are loaded in turn by ``wrk`` with the same JSON request,
``--rounds`` times each, alternating so that the machine's drift falls on both. Prints one JSON line per
measurement, then the medians and the ratios (on / off), and the shadow checks the first server made.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest.common import start_server, wait_warm
from loadtest.compare import MODELS, cpu_line, model_file, run_wrk, wrk_script
from server.settings import Settings
from tests.integration.serverproc import metric_value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="cls")
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--duration", type=int, default=10, help="seconds of load per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    input_name, shape = MODELS[args.model]
    default_rate = Settings.model_fields["shadow_rate"].default
    print(json.dumps({"cpu": cpu_line(), "model": args.model, "shape": shape, "shadow_rate": default_rate}))
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    body = json.dumps({"inputs": {input_name: x.tolist()}}).encode()
    config = json.dumps({"warm_buckets": [{input_name: list(shape)}]})
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as folder:
        model = model_file(args.model, Path(folder)).read_bytes()
        script = wrk_script(Path(folder), "predict", body, {"content-type": "application/json"})
        servers = {}
        try:
            for mode, rate in (("on", default_rate), ("off", 0)):
                data_dir = str(Path(folder) / mode)
                servers[mode] = start_server(data_dir, routing="compiled", tuning_enabled="false", shadow_rate=rate)
            for _, url in servers.values():
                files = {"model": ("m.onnx", model), "config": ("c.json", config)}
                httpx.put(f"{url}/models/m", files=files, timeout=600).raise_for_status()
                wait_warm(url, ["m"])
                engine = httpx.post(f"{url}/models/m/predict", content=body, timeout=60).json()["engine"]
                if engine == "onnxruntime":
                    raise SystemExit("the bucket's kernel does not serve (not compiled or verified): nothing to check")
            for _ in range(args.rounds):
                for mode, (_, url) in servers.items():
                    result = run_wrk(f"{url}/models/m/predict", script, args.connections, args.duration)
                    runs[mode].append(result)
                    print(json.dumps({"shadow": mode, **result}), flush=True)
            checks = metric_value(httpx.get(f"{servers['on'][1]}/metrics").text, "jitserve_shadow_checks_total")
        finally:
            for process, _ in servers.values():
                process.terminate()
                process.wait(60)
    medians = {mode: {k: statistics.median(r[k] for r in results) for k in ("rps", "p50_ms", "p99_ms")}
               for mode, results in runs.items()}  # fmt: skip
    print(json.dumps({"medians": medians, "shadow_checks": checks}))
    print(json.dumps({k: round(medians["on"][k] / medians["off"][k], 3) for k in ("rps", "p50_ms", "p99_ms")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
