"""jitserve's request path against the naive FastAPI + ONNX Runtime server, same model, same load,
one run (in the spirit of Triton's perf_analyzer):

    .venv/bin/python loadtest/compare.py [--models demo cls] [--connections 1 8 32] [--duration 10]
        [--jit [--no-tuning]]

For each model it starts the naive server (``loadtest/naive_server.py``) in both forms a newcomer
writes (``def`` on FastAPI's thread pool, and ``async def`` running ONNX Runtime on the event loop)
and one jitserve process (ONNX Runtime serving every bucket unless ``--jit``, so that the request
path is what differs), then drives them at every connection count: with ``wrk`` (Debian's package)
the naive servers with JSON, jitserve with JSON on ``/predict``, with V2 binary tensors, and with V2
binary tensors on a copy of the model with dynamic batching; with ``h2load`` (Debian's
``nghttp2-client``) jitserve's gRPC ``ModelInfer`` with raw contents, on both copies. A
connection count is concurrent calls: wrk's connections, h2load's streams over
``--grpc-connections`` connections. Every request is one batch-1 input. It prints one Markdown
table of req/s, p50 and p99 with the ratio to the naive reference (the faster naive form at that
load) and to jitserve's REST V2 binary, then the V2 binary overhead: a sequential client's round
trip minus the engine's share (``Server-Timing``), p50. JSON lines go to ``DIR/compare.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import orjson

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from compiler.models.demo import demo_model_bytes  # noqa: E402
from loadtest.common import free_port, start_server, wait_warm  # noqa: E402
from server.grpc_api import messages as grpc_messages  # noqa: E402
from tests.realmodels import CLS, real_model  # noqa: E402

MODELS = {"demo": ("x", (1, 4)), "cls": ("x", (1, 3, 48, 192))}
BATCHING = {"max_batch_size": 8, "max_queue_delay_us": 2000}
OVERHEAD_REQUESTS = 400


def cpu_line() -> str:
    """The CPU model and its widest vector ISA: TVM's standing against ONNX Runtime depends on both."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"model name\s*:\s*(.+)", text)
    flags = set((re.search(r"flags\s*:\s*(.+)", text) or [None, ""])[1].split())
    isa = "AVX-512" if "avx512f" in flags else "AVX2 (no AVX-512)" if "avx2" in flags else "no AVX2"
    return f"{model[1].strip() if model else platform.processor()}, {isa}, {os.cpu_count()} cores"


def model_file(name: str, folder: Path) -> Path:
    if name == "demo":
        path = folder / "demo.onnx"
        path.write_bytes(demo_model_bytes())
        return path
    return real_model(CLS)


NAIVE_FORMS = {"naive (thread pool)": {}, "naive (inline async)": {"NAIVE_INLINE": "1"}}
"""The two handlers a newcomer writes, by the name the table gives them: the faster is the reference."""


def start_naive(model: Path, form: dict[str, str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "loadtest.naive_server:app", "--port", str(port), "--log-level", "warning"],
        cwd=REPO,
        env=dict(os.environ, NAIVE_MODEL=str(model), **form),
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            httpx.get(f"{url}/docs", timeout=1)
            return process, url
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError("naive server did not start")


def v2_binary_body(input_name: str, x: np.ndarray) -> tuple[bytes, int]:
    head = orjson.dumps(
        {
            "inputs": [
                {
                    "name": input_name,
                    "shape": list(x.shape),
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ],
            "parameters": {"binary_data_output": True},
        }
    )
    return head + x.tobytes(), len(head)


def grpc_body(folder: Path, name: str, model: str, input_name: str, x: np.ndarray) -> Path:
    """One ``ModelInfer`` call with raw contents, framed as gRPC puts it on HTTP/2 (a flag byte, a length)."""
    request = grpc_messages.ModelInferRequest(model_name=model, raw_input_contents=[x.tobytes()])
    request.inputs.add(name=input_name, datatype="FP32", shape=x.shape)
    message = request.SerializeToString()
    path = folder / f"{name}.grpc"
    path.write_bytes(b"\0" + struct.pack(">I", len(message)) + message)
    return path


def run_h2load(url: str, body: Path, streams: int, *, connections: int, seconds: int, log: Path) -> dict:
    """gRPC unary calls at ``streams`` in flight over ``connections`` HTTP/2 connections; latencies from h2load's
    per-request log. gRPC errors travel in trailers behind HTTP 200: the caller counts them from the server."""
    connections = min(connections, streams)
    log.unlink(missing_ok=True)  # h2load appends
    out = subprocess.run(
        ["h2load", "-t1", f"-c{connections}", f"-m{-(-streams // connections)}", f"-D{seconds}", f"--log-file={log}",
         "-H", "content-type: application/grpc", "-H", "te: trailers", "-d", str(body), url],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    latencies = sorted(int(line.split("\t")[2]) / 1000 for line in log.read_text().splitlines() if line)
    failed = re.search(r"requests: .*?(\d+) failed, (\d+) errored", out)
    return {
        "rps": float(re.search(r"finished in [\d.]+s, ([\d.]+) req/s", out)[1]),
        "p50_ms": latencies[len(latencies) // 2],
        "p99_ms": latencies[int(len(latencies) * 0.99)],
        "errors": int(failed[1]) + int(failed[2]),
    }


def grpc_failures(url: str) -> float:
    """ModelInfer calls that did not end OK, from the server's own count."""
    text = httpx.get(f"{url}/metrics").text
    found = re.findall(r'^jitserve_grpc_calls_total\{code="(\w+)",method="ModelInfer"\} ([\d.e+]+)$', text, re.M)
    return sum(float(n) for code, n in found if code != "OK")


def wrk_script(folder: Path, name: str, body: bytes, headers: dict[str, str]) -> Path:
    body_path = folder / f"{name}.body"
    body_path.write_bytes(body)
    lines = ['wrk.method = "POST"', f'local f = io.open("{body_path}", "rb")', "wrk.body = f:read('*a')", "f:close()"]
    lines += [f'wrk.headers["{key}"] = "{value}"' for key, value in headers.items()]
    script = folder / f"{name}.lua"
    script.write_text("\n".join(lines) + "\n")
    return script


def run_wrk(url: str, script: Path, connections: int, seconds: int) -> dict:
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", "-s", str(script), url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout

    def ms(label: str) -> float:
        value, unit = re.search(rf"^\s+{label}\s+([\d.]+)(us|ms|s)\s*$", out, re.M).groups()
        return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]

    errors = sum(int(n) for n in re.findall(r"Non-2xx or 3xx responses: (\d+)", out))
    errors += sum(int(n) for n in re.findall(r"(?:connect|read|write|timeout) (\d+)", out))
    return {
        "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out)[1]),
        "p50_ms": ms("50%"),
        "p99_ms": ms("99%"),
        "errors": errors,
    }


def sequential_overhead(url: str, path: str, body: bytes, headers: dict[str, str]) -> dict:
    """Round trip minus the engine's share, over one keep-alive connection with prebuilt bytes
    (a client costing tens of microseconds, so that the server's overhead is what shows)."""
    host, port = url.removeprefix("http://").split(":")
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    request = head.encode() + body
    rtts, engines = [], []
    with socket.create_connection((host, int(port))) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = sock.makefile("rb")
        for i in range(OVERHEAD_REQUESTS + 50):
            started = time.perf_counter()
            sock.sendall(request)
            status = reader.readline()
            length, timing = 0, None
            while (line := reader.readline()) not in (b"\r\n", b""):
                key, _, value = line.decode().partition(":")
                if key.lower() == "content-length":
                    length = int(value)
                elif key.lower() == "server-timing":
                    timing = float(value.split("dur=")[1])
            reader.read(length)
            rtt = (time.perf_counter() - started) * 1000
            if not status.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"overhead request failed: {status!r}")
            if i >= 50:  # warm-up first
                rtts.append(rtt)
                engines.append(timing)
    beyond = [rtt - engine for rtt, engine in zip(rtts, engines, strict=True)]
    return {
        "rtt_p50_ms": statistics.median(rtts),
        "engine_p50_ms": statistics.median(engines),
        "beyond_engine_p50_ms": statistics.median(beyond),
    }


def compare(name: str, args: argparse.Namespace, folder: Path) -> list[dict]:
    input_name, shape = MODELS[name]
    path = model_file(name, folder)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    json_body = orjson.dumps({"model": name, "inputs": {input_name: x.tolist()}})
    binary, head_length = v2_binary_body(input_name, x)
    json_headers = {"Content-Type": "application/json"}
    binary_headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(head_length)}

    settings = ({"tuning_enabled": False} if args.no_tuning else {}) if args.jit else {"compile_workers": 0}
    grpc_port = free_port()
    jitserve, url = start_server(str(folder / f"data-{name}"), grpc_port=grpc_port, **settings)
    naives = {form: start_naive(path, env) for form, env in NAIVE_FORMS.items()}
    grpc_url = f"http://127.0.0.1:{grpc_port}/inference.GRPCInferenceService/ModelInfer"
    rows: list[dict] = []
    try:
        # With --jit, every batch bucket a load can reach is compiled and routed before it runs.
        warm = {"warm_buckets": [{input_name: [b, *shape[1:]]} for b in (1, 2, 4, 8)]} if args.jit else {}
        for model, config in ((name, warm), (f"{name}-batched", {**warm, "dynamic_batching": BATCHING})):
            files = {"model": ("model.onnx", path.read_bytes()), "config": ("config.json", json.dumps(config))}
            httpx.put(f"{url}/models/{model}", files=files, timeout=300).raise_for_status()
        wait_warm(url, [name, f"{name}-batched"])
        naive_script = wrk_script(folder, f"{name}-naive", json_body, json_headers)
        json_script = wrk_script(folder, f"{name}-json", json_body, json_headers)
        # (server, load, the model it reaches or None, a function of (connections, seconds) -> result)
        loads = [(form, "JSON", None, _wrk(f"{base}/predict", naive_script)) for form, (_, base) in naives.items()]
        loads += [
            ("jitserve", "JSON", name, _wrk(f"{url}/predict", json_script)),
            ("jitserve", "V2 binary", name,
             _wrk(f"{url}/v2/models/{name}/infer", wrk_script(folder, f"{name}-v2", binary, binary_headers))),
            ("jitserve", "V2 binary, dynamic batching", f"{name}-batched",
             _wrk(f"{url}/v2/models/{name}-batched/infer", wrk_script(folder, f"{name}-v2b", binary, binary_headers))),
        ]  # fmt: skip
        for model, load in ((name, "gRPC raw"), (f"{name}-batched", "gRPC raw, dynamic batching")):
            body = grpc_body(folder, model, model, input_name, x)
            loads.append(("jitserve", load, model, _h2load(grpc_url, body, args.grpc_connections, folder / "h2.log")))
        for connections in args.connections:
            for server, load, model, drive in loads:
                drive(connections, 2)  # warm-up: buckets seen, kernels and routes settled
                failed = grpc_failures(url)
                result = drive(connections, args.duration)
                if load.startswith("gRPC"):
                    result["errors"] += int(grpc_failures(url) - failed)
                row = {"model": name, "server": server, "load": load, "connections": connections, **result}
                if model is not None:  # the engines serving the model the load reached, as routing chose
                    buckets = httpx.get(f"{url}/models/{model}").json()["buckets"]
                    row["engines"] = "+".join(sorted({bucket["engine"] for bucket in buckets}))
                rows.append(row)
                print(json.dumps(rows[-1]), file=sys.stderr)
        overhead = sequential_overhead(url, f"/v2/models/{name}/infer", binary, binary_headers)
        rows.append({"model": name, "server": "jitserve", "load": "V2 binary, sequential overhead", **overhead})
    finally:
        for process in (jitserve, *(process for process, _ in naives.values())):
            process.terminate()
            process.wait(30)
    return rows


def _wrk(url: str, script: Path):
    return lambda connections, seconds: run_wrk(url, script, connections, seconds)


def _h2load(url: str, body: Path, grpc_connections: int, log: Path):
    return lambda streams, seconds: run_h2load(
        url, body, streams, connections=grpc_connections, seconds=seconds, log=log
    )


def table(rows: list[dict]) -> str:
    """The loads with their ratios to the naive reference (the faster naive form at that model and load) and to
    jitserve's REST V2 binary."""
    lines = [
        "| model | connections | server, load | req/s | p50 ms | p99 ms | errors | vs naive reference | "
        "vs V2 binary | engines |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    reference: dict[tuple, float] = {}
    binary: dict[tuple, float] = {}
    for r in rows:
        key = (r["model"], r.get("connections"))
        if r["server"] in NAIVE_FORMS:
            reference[key] = max(reference.get(key, 0.0), r["rps"])
        elif r["load"] == "V2 binary":
            binary[key] = r["rps"]
    for r in rows:
        if "rps" not in r:
            continue
        key = (r["model"], r["connections"])
        versus_binary = f"{r['rps'] / binary[key]:.2f}x" if r["server"] == "jitserve" and key in binary else ""
        lines.append(
            f"| {r['model']} | {r['connections']} | {r['server']}, {r['load']} | {r['rps']:,.0f} | "
            f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['errors']} | {r['rps'] / reference[key]:.2f}x | "
            f"{versus_binary} | {r.get('engines', 'onnxruntime')} |"
        )
    for r in rows:
        if "beyond_engine_p50_ms" in r:
            lines.append(
                f"\n{r['model']}, V2 binary, one connection: round trip p50 {r['rtt_p50_ms']:.3f} ms, engine "
                f"{r['engine_p50_ms']:.3f} ms, beyond the engine {r['beyond_engine_p50_ms']:.3f} ms"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["demo", "cls"])
    parser.add_argument("--connections", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--duration", type=int, default=10, help="seconds of load per measurement")
    parser.add_argument("--jit", action="store_true", help="let jitserve compile and route kernels too")
    parser.add_argument(
        "--no-tuning", action="store_true", help="with --jit: no background tuning (its compiles share the cores)"
    )
    parser.add_argument(
        "--grpc-connections", type=int, default=1, help="HTTP/2 connections the gRPC calls share (a channel: 1)"
    )
    parser.add_argument("--out", type=Path, default=REPO / "loadtest" / "results")
    args = parser.parse_args()
    for program, package in (("wrk", "wrk"), ("h2load", "nghttp2-client")):
        if shutil.which(program) is None:
            print(f"{program} not found: apt-get install {package}", file=sys.stderr)
            return 2
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models:
            rows += compare(name, args, Path(folder))
    with open(args.out / "compare.jsonl", "w") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"{cpu_line()}; server and wrk on the same machine\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
