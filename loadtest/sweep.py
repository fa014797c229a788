"""A concurrency sweep per protocol, in the spirit of Triton's perf_analyzer: req/s, p50 and p99 of one
jitserve at each load, for REST JSON (``/predict``), REST V2 binary tensors and gRPC with raw tensors.

    .venv/bin/python loadtest/sweep.py [--models demo cls] [--concurrency 1 2 4 8 16 32 64] [--duration 3]
    make loadtest

ONNX Runtime serves every bucket (no compiles), so what differs is the request path. The REST loads are
driven by ``wrk`` (Debian's package), gRPC by ``h2load`` (Debian's ``nghttp2-client``) over one HTTP/2
connection (a client's channel; ``--grpc-connections``), a concurrency being the calls in flight; every
request is one batch-1 input. Prints one Markdown
table per model (each protocol's req/s and p99 at each concurrency, and gRPC's req/s over V2 binary's), writes
``DIR/sweep.jsonl`` and plots req/s and p99 against concurrency to ``DIR/sweep-<model>.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import httpx
import numpy as np
import orjson

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loadtest.common import free_port, start_server  # noqa: E402
from loadtest.compare import (  # noqa: E402
    MODELS,
    cpu_line,
    grpc_body,
    model_file,
    run_h2load,
    run_wrk,
    v2_binary_body,
    wrk_script,
)

PROTOCOLS = ("REST JSON", "REST V2 binary", "gRPC raw")


def sweep(name: str, args: argparse.Namespace, folder: Path) -> list[dict]:
    input_name, shape = MODELS[name]
    path = model_file(name, folder)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    grpc_port = free_port()
    server, url = start_server(str(folder / f"data-{name}"), grpc_port=grpc_port, compile_workers=0)
    rows = []
    try:
        httpx.put(f"{url}/models/{name}", files={"model": ("model.onnx", path.read_bytes())}, timeout=300,
                  verify=False).raise_for_status()  # fmt: skip
        binary, head = v2_binary_body(input_name, x)
        json_headers = {"Content-Type": "application/json"}
        binary_headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(head)}
        json_body = orjson.dumps({"model": name, "inputs": {input_name: x.tolist()}})
        json_script = wrk_script(folder, f"{name}-json", json_body, json_headers)
        binary_script = wrk_script(folder, f"{name}-v2", binary, binary_headers)
        body = grpc_body(folder, name, name, input_name, x)
        grpc_url = f"http://127.0.0.1:{grpc_port}/inference.GRPCInferenceService/ModelInfer"
        drives = {
            "REST JSON": lambda c, s: run_wrk(f"{url}/predict", json_script, c, s),
            "REST V2 binary": lambda c, s: run_wrk(f"{url}/v2/models/{name}/infer", binary_script, c, s),
            "gRPC raw": lambda c, s: run_h2load(
                grpc_url, body, c, connections=args.grpc_connections, seconds=s, log=folder / "h2.log"
            ),
        }
        for concurrency in args.concurrency:
            for protocol, drive in drives.items():
                drive(concurrency, 1)  # warm-up
                row = {"model": name, "protocol": protocol, "concurrency": concurrency,
                       **drive(concurrency, args.duration)}  # fmt: skip
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        server.terminate()
        server.wait(30)
    return rows


def table(name: str, rows: list[dict]) -> str:
    by = {(r["protocol"], r["concurrency"]): r for r in rows if r["model"] == name}
    levels = sorted({r["concurrency"] for r in rows if r["model"] == name})
    lines = [
        "| concurrency | " + " | ".join(f"{p} req/s | {p} p99 ms" for p in PROTOCOLS) + " | gRPC / V2 binary |",
        "| --- | " + " | ".join("--- | ---" for _ in PROTOCOLS) + " | --- |",
    ]
    for level in levels:
        cells = []
        for protocol in PROTOCOLS:
            r = by.get((protocol, level))
            cells.append(f"{r['rps']:,.0f} | {r['p99_ms']:.2f}" if r else " | ")
        grpc, binary = by.get(("gRPC raw", level)), by.get(("REST V2 binary", level))
        ratio = f"{grpc['rps'] / binary['rps']:.2f}x" if grpc and binary else ""
        lines.append(f"| {level} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


def plot(name: str, rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (rate, tail) = plt.subplots(1, 2, figsize=(10, 3.8))
    for protocol in PROTOCOLS:
        points = sorted((r["concurrency"], r["rps"], r["p99_ms"]) for r in rows
                        if r["model"] == name and r["protocol"] == protocol)  # fmt: skip
        if points:
            levels, rps, p99 = zip(*points, strict=True)
            rate.plot(levels, rps, marker="o", label=protocol)
            tail.plot(levels, p99, marker="o", label=protocol)
    for axes, label in ((rate, "req/s"), (tail, "p99 ms")):
        axes.set_xscale("log", base=2)
        axes.set_xlabel("concurrent calls")
        axes.set_ylabel(label)
        axes.grid(alpha=0.3)
    tail.set_yscale("log")
    rate.legend()
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["demo", "cls"])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--duration", type=int, default=3, help="seconds of load per point")
    parser.add_argument(
        "--grpc-connections", type=int, default=1, help="HTTP/2 connections the gRPC calls share (a channel: 1)"
    )
    parser.add_argument("--out", type=Path, default=REPO / "loadtest" / "results")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cpu = cpu_line()
    rows = []
    with tempfile.TemporaryDirectory(prefix="sweep-") as tmp:
        for name in args.models:
            rows += sweep(name, args, Path(tmp))
    (args.out / "sweep.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{cpu}; server, load generator and client on the same machine\n")
    for name in args.models:
        print(f"### {name}\n\n{table(name, rows)}\n")
        plot(name, rows, args.out / f"sweep-{name}.png", f"{name}, batch 1, ONNX Runtime serving; {cpu}")
    print(f"plots: {args.out}/sweep-<model>.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
