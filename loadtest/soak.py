"""Soak: many clients for many minutes with shape churn and model churn, against a real server with
compiles and tuning on. Prints the answers by status, latency p50/p99, and the server's RSS (and its
children's) over time; writes the RSS curve as a PNG and the figures as JSON::

    .venv/bin/python loadtest/soak.py --clients 64 --minutes 10 --out loadtest/results/soak

Clients send ``/predict`` (JSON) and V2 ``infer`` to the demo model at batch sizes drawn from 1-64, so
new buckets keep arriving for compile admission; one more client uploads, uses and deletes models of
several sizes (the demo, encoders with ~0.05 and ~48 MiB of weights and a warm bucket) over and over.
Any answer but 200 (and the 201/204 of the churn) counts as an error; the exit status
is 1 when there was one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compiler.models.demo import demo_model_bytes
from loadtest.common import start_server
from loadtest.compare import cpu_line
from tests import synthetic


class Tally:
    """Answers and latencies from every client thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.statuses: dict[str, int] = {}
        self.latencies: list[float] = []
        self.errors: list[str] = []

    def add(self, what: str, status: int, seconds: float, ok: bool, text: str = "") -> None:
        with self.lock:
            key = f"{what} {status}"
            self.statuses[key] = self.statuses.get(key, 0) + 1
            self.latencies.append(seconds)
            if not ok and len(self.errors) < 20:
                self.errors.append(f"{key}: {text[:200]}")


def request(tally: Tally, client: httpx.Client, what: str, method: str, path: str, *, ok=(200,), **kwargs) -> None:
    started = time.perf_counter()
    try:
        response = client.request(method, path, **kwargs)
    except httpx.HTTPError as exc:
        tally.add(what, 0, time.perf_counter() - started, False, repr(exc))
        return
    good = response.status_code in ok
    tally.add(what, response.status_code, time.perf_counter() - started, good, "" if good else response.text)


def predict_client(url: str, seed: int, stop: threading.Event, tally: Tally) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=120) as client:
        while not stop.is_set():
            rows = np.random.default_rng(rng.randrange(2**32)).standard_normal((rng.randint(1, 64), 4))
            if rng.random() < 0.7:
                body = {"inputs": {"x": rows.astype(np.float32).tolist()}}
                request(tally, client, "predict", "POST", "/models/demo/predict", json=body)
            else:
                tensor = {"name": "x", "datatype": "FP32", "shape": list(rows.shape), "data": rows.ravel().tolist()}
                request(tally, client, "infer", "POST", "/v2/models/demo/infer", json={"inputs": [tensor]})


def churn_models() -> list[tuple[bytes, dict | None, dict]]:
    """The models the churn client cycles through, of several sizes: (bytes, config, a request body). The
    encoders have a warm bucket, so their kernels compile and their weights are mapped, then released."""
    models = [(demo_model_bytes(), None, {"inputs": {"x": [[1.0, 2.0, 3.0, 4.0]]}})]
    for layers, hidden in ((1, 64), (4, 512)):  # ~0.05 and ~48 MiB of weights
        shape = [1, 16, hidden]
        config = {"axes": {"batch": {"kind": "pow2", "min": 1, "max": 4}}, "warm_buckets": [{"x": shape}]}
        body = {"inputs": {"x": np.ones(shape, np.float32).tolist()}}
        models.append((synthetic.bert_encoder_model(layers=layers, hidden=hidden, heads=4, seq=16), config, body))
    return models


def churn_client(url: str, stop: threading.Event, tally: Tally) -> None:
    models = churn_models()
    with httpx.Client(base_url=url, timeout=120) as client:
        while not stop.is_set():
            for data, config, body in models:
                files = {"model": ("model.onnx", data)}
                if config is not None:
                    files["config"] = ("config.json", json.dumps(config))
                request(tally, client, "upload", "PUT", "/models/churn", ok=(201,), files=files)
                for _ in range(3):
                    request(tally, client, "churn-predict", "POST", "/models/churn/predict", json=body)
                request(tally, client, "delete", "DELETE", "/models/churn", ok=(204,))


def sample_rss(process: psutil.Process, started: float, stop: threading.Event, samples: list) -> None:
    while not stop.wait(1.0):
        with contextlib.suppress(psutil.Error):
            children = 0
            for child in process.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    children += child.memory_info().rss
            samples.append((time.monotonic() - started, process.memory_info().rss, children))


def plot(samples: list, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seconds = [s[0] / 60 for s in samples]
    figure, axes = plt.subplots(figsize=(9, 4))
    axes.plot(seconds, [s[1] / 2**20 for s in samples], label="server RSS")
    axes.plot(seconds, [s[2] / 2**20 for s in samples], label="compile/tuning children RSS")
    axes.set_xlabel("minutes")
    axes.set_ylabel("MiB")
    axes.set_title(title, fontsize=9)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def rss_by_minute(samples: list) -> list[tuple[int, int]]:
    """(lowest, highest) server RSS in MiB per minute: with models coming and going, a flat run keeps its
    lows flat."""
    minutes: dict[int, list[float]] = {}
    for seconds, rss, _ in samples:
        minutes.setdefault(int(seconds // 60), []).append(rss / 2**20)
    return [(round(min(values)), round(max(values))) for _, values in sorted(minutes.items())]


def run(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        server, url = start_server(folder, demo_model="true", **dict(args.setting))
        try:
            with httpx.Client(base_url=url, timeout=120) as client:
                deadline = time.monotonic() + 300
                while client.get("/readyz").status_code != 200 and time.monotonic() < deadline:
                    time.sleep(0.5)
            tally, stop, samples = Tally(), threading.Event(), []
            started = time.monotonic()
            threads = [
                threading.Thread(target=predict_client, args=(url, seed, stop, tally)) for seed in range(args.clients)
            ]
            threads.append(threading.Thread(target=churn_client, args=(url, stop, tally)))
            threads.append(
                threading.Thread(target=sample_rss, args=(psutil.Process(server.pid), started, stop, samples))
            )
            for thread in threads:
                thread.start()
            time.sleep(args.minutes * 60)
            stop.set()
            for thread in threads:
                thread.join(180)
            alive = server.poll() is None
        finally:
            server.terminate()
            server.wait(30)
    warm = [s for s in samples if s[0] >= args.warmup_minutes * 60] or samples
    latencies = np.asarray(tally.latencies) * 1000
    errors = sum(n for key, n in tally.statuses.items() if key.split()[1] not in ("200", "201", "204"))
    return {
        "cpu": cpu_line(),
        "clients": args.clients,
        "minutes": args.minutes,
        "requests": len(tally.latencies),
        "errors": errors,
        "statuses": tally.statuses,
        "first_errors": tally.errors,
        "p50_ms": float(np.percentile(latencies, 50)) if len(latencies) else None,
        "p99_ms": float(np.percentile(latencies, 99)) if len(latencies) else None,
        "rss_mib_after_warmup": {
            "first": warm[0][1] / 2**20 if warm else None,
            "max": max(s[1] for s in warm) / 2**20 if warm else None,
            "last": warm[-1][1] / 2**20 if warm else None,
        },
        "rss_mib_by_minute": rss_by_minute(samples),
        "children_rss_mib_max": max((s[2] for s in samples), default=0) / 2**20,
        "server_alive_at_end": alive,
        "samples": samples,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--warmup-minutes", type=float, default=1)
    parser.add_argument("--out", type=Path, default=Path("loadtest/results/soak"), help="PATH.png and PATH.json")
    parser.add_argument(
        "--setting", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"), help="a JITSERVE_ setting"
    )
    args = parser.parse_args(argv)
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    title = f"{args.clients} clients, {args.minutes:g} min, {result['cpu']}"
    plot(result["samples"], args.out.with_suffix(".png"), title)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    rss = result["rss_mib_after_warmup"]
    print(title)
    print(f"requests {result['requests']}, errors {result['errors']}: {result['statuses']}")
    print(f"latency p50 {result['p50_ms']:.1f} ms, p99 {result['p99_ms']:.1f} ms")
    print(
        f"server RSS after warm-up: first {rss['first']:.0f} MiB, max {rss['max']:.0f} MiB, last {rss['last']:.0f}"
        f" MiB; children max {result['children_rss_mib_max']:.0f} MiB"
    )
    print("server RSS per minute (low, high MiB): " + ", ".join(f"{lo}-{hi}" for lo, hi in result["rss_mib_by_minute"]))
    for line in result["first_errors"]:
        print("  ", line)
    return 0 if result["errors"] == 0 and result["server_alive_at_end"] else 1


if __name__ == "__main__":
    sys.exit(main())
