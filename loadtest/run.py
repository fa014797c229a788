"""Headless load test with shape churn; writes a JSON summary and a latency PNG.

    .venv/bin/python loadtest/run.py [--users 8] [--duration 180] [--out loadtest/results]

Starts a real jitserve on a free loopback port (fresh data dir), uploads the
per-token MLP of ``scenario.py``, runs the locust scenario of
``locustfile.py`` in-process, polls ``/metrics`` every second for compiles
and recompiles, and writes ``summary.json`` (requests/s, p50/p95/p99,
errors, distinct shapes, buckets, compiles and recompiles during the run,
compiles per distinct shape, mean padding waste of kernel-served requests)
and ``latency.png`` (latency over time with compile events marked).
"""

from __future__ import annotations

# locust patches the standard library (gevent) on import: it comes first.
# isort: off
import locust
from locust.env import Environment

# isort: on

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import gevent
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import start_server  # noqa: E402
from locustfile import MODEL, JitserveUser  # noqa: E402
from scenario import CONFIG, token_mlp_bytes  # noqa: E402


def _metric_total(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


def _upload(url: str) -> None:
    boundary = "jitserveloadtest"
    parts = [
        ("model", "model.onnx", "application/octet-stream", token_mlp_bytes()),
        ("config", "config.json", "application/json", json.dumps(CONFIG).encode()),
    ]
    body = b""
    for field, filename, content_type, data in parts:
        body += (
            (
                f'--{boundary}\r\nContent-Disposition: form-data; name="{field}"; filename="{filename}"\r\n'
                f"Content-Type: {content_type}\r\n\r\n"
            ).encode()
            + data
            + b"\r\n"
        )
    body += f"--{boundary}--\r\n".encode()
    request = urllib.request.Request(
        f"{url}/models/{MODEL}",
        data=body,
        method="PUT",
        headers={"content-type": f"multipart/form-data; boundary={boundary}"},
    )
    urllib.request.urlopen(request, timeout=120).read()


def run(users: int, duration: float, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    samples: list[tuple[float, float, str, bool]] = []  # (t, ms, shape, failed)
    compile_counts: list[tuple[float, float]] = []

    def on_request(request_type, name, response_time, response_length, exception=None, **_):
        samples.append((time.monotonic(), float(response_time), name, exception is not None))

    with tempfile.TemporaryDirectory() as data_dir:
        process, url = start_server(data_dir)
        try:
            _upload(url)
            compiles_before = _metric_total(url, "jitserve_compiles_total")
            recompiles_before = _metric_total(url, "jitserve_recompiles_total")
            environment = Environment(user_classes=[JitserveUser], events=locust.events, host=url)
            environment.events.request.add_listener(on_request)
            runner = environment.create_local_runner()
            started = time.monotonic()

            def poll_metrics():
                while time.monotonic() - started < duration + 2:
                    compile_counts.append((time.monotonic(), _metric_total(url, "jitserve_compiles_total")))
                    gevent.sleep(1.0)

            poller = gevent.spawn(poll_metrics)
            runner.start(users, spawn_rate=users)
            gevent.spawn_later(duration, runner.quit)
            runner.greenlet.join()
            poller.join(timeout=5)
            elapsed = time.monotonic() - started
            compiles = _metric_total(url, "jitserve_compiles_total") - compiles_before
            recompiles = _metric_total(url, "jitserve_recompiles_total") - recompiles_before
            waste = _metric_total(url, "jitserve_padding_waste_ratio_sum")
            padded_requests = _metric_total(url, "jitserve_padding_waste_ratio_count")
            buckets = json.loads(urllib.request.urlopen(f"{url}/models/{MODEL}", timeout=10).read())["buckets"]
        finally:
            process.terminate()
            process.wait(60)

    latencies = np.array([ms for _, ms, _, _ in samples])
    distinct_shapes = len({name for _, _, name, _ in samples})
    summary = {
        "duration_seconds": round(elapsed, 1),
        "users": users,
        "requests": len(samples),
        "requests_per_second": round(len(samples) / elapsed, 2),
        "p50_ms": round(float(np.percentile(latencies, 50)), 2),
        "p95_ms": round(float(np.percentile(latencies, 95)), 2),
        "p99_ms": round(float(np.percentile(latencies, 99)), 2),
        "errors": sum(failed for *_, failed in samples),
        "distinct_shapes": distinct_shapes,
        "buckets": len(buckets),
        "buckets_by_engine": {
            engine: sum(b["engine"] == engine for b in buckets) for engine in sorted({b["engine"] for b in buckets})
        },
        "compiles": int(compiles),
        "recompiles": int(recompiles),
        "compiles_per_distinct_shape": round(compiles / max(1, distinct_shapes), 4),
        "kernel_served_requests": int(padded_requests),
        "mean_padding_waste": round(waste / padded_requests, 4) if padded_requests else None,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    _plot(samples, compile_counts, started, out / "latency.png", summary)
    return summary


def _plot(samples, compile_counts, started, path: Path, summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seconds = np.array([t - started for t, *_ in samples])
    latencies = np.array([ms for _, ms, _, _ in samples])
    edges = np.arange(0, max(1, int(seconds.max()) + 2))
    p50, p99 = [], []
    for lo in edges[:-1]:
        window = latencies[(seconds >= lo) & (seconds < lo + 1)]
        p50.append(np.percentile(window, 50) if window.size else np.nan)
        p99.append(np.percentile(window, 99) if window.size else np.nan)
    figure, axes = plt.subplots(figsize=(10, 4))
    axes.scatter(seconds, latencies, s=2, alpha=0.2, color="grey", label="requests")
    axes.plot(edges[:-1], p50, label="p50 (1 s)")
    axes.plot(edges[:-1], p99, label="p99 (1 s)")
    previous = compile_counts[0][1] if compile_counts else 0
    marked = False
    for t, count in compile_counts:
        if count > previous:
            axes.axvline(t - started, color="red", alpha=0.3, label=None if marked else "compile finished")
            marked = True
        previous = count
    axes.set_yscale("log")
    axes.set_xlabel("seconds")
    axes.set_ylabel("latency (ms)")
    axes.set_title(
        f"{summary['requests']} requests, {summary['distinct_shapes']} shapes, "
        f"{summary['buckets']} buckets, {summary['compiles']} compiles, p99 {summary['p99_ms']} ms"
    )
    axes.legend(loc="upper right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--duration", type=float, default=180, help="seconds of load")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    summary = run(args.users, args.duration, args.out)
    print(json.dumps(summary, indent=2))
    print(f"wrote {args.out / 'summary.json'} and {args.out / 'latency.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
