"""What the load scripts share: a real server on a free loopback port, shapes, configs."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(data_dir: str, **settings) -> tuple[subprocess.Popen, str]:
    """``python -m server`` on 127.0.0.1 with ``JITSERVE_*`` settings; returns (process, url). gRPC is off
    unless ``grpc_port`` is given."""
    port = free_port()
    env = dict(os.environ, JITSERVE_DATA_DIR=data_dir, JITSERVE_PORT=str(port), JITSERVE_DEMO_MODEL="false")
    env["JITSERVE_GRPC_PORT"] = "0"
    env.update({f"JITSERVE_{k.upper()}": str(v) for k, v in settings.items()})
    process = subprocess.Popen(
        [sys.executable, "-m", "server"], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(f"{url}/healthz", timeout=1, verify=False).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("server did not start")


def add_bucket_arguments(parser: argparse.ArgumentParser, *, requests: int = 300) -> None:
    """MODEL, --shape (one per input), --config and --requests: what every single-bucket benchmark takes."""
    parser.add_argument("model", type=Path)
    parser.add_argument("--shape", action="append", required=True, metavar="NAME=D0,D1,...")
    parser.add_argument("--config", type=Path)
    parser.add_argument("--requests", type=int, default=requests)


def parse_shapes(items: list[str]) -> dict[str, tuple[int, ...]]:
    """``["x=1,3,48,192"]`` -> ``{"x": (1, 3, 48, 192)}``."""
    shapes = {}
    for item in items:
        name, _, dims = item.rpartition("=")
        shapes[name] = tuple(int(d) for d in dims.split(","))
    return shapes


def config_with_warm_bucket(path: Path | None, shapes: dict[str, tuple[int, ...]]) -> dict:
    """The model config from ``path`` (or empty), warming the measured bucket."""
    config = json.loads(path.read_text()) if path else {}
    config.setdefault("warm_buckets", [{k: list(v) for k, v in shapes.items()}])
    return config


def wait_warm(url: str, names: list[str], timeout: float = 1200) -> None:
    """Until every warm bucket of ``names`` is ready or failed. ``/readyz`` does not wait for models
    uploaded after the start: ONNX Runtime serves them while they compile."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        described = [httpx.get(f"{url}/models/{name}", timeout=10).json() for name in names]
        probed = all(d["padding_probe"]["state"] in ("done", "failed") for d in described)  # warm buckets known
        buckets = [b for d in described for b in d["buckets"]]
        if probed and all(b["state"] in ("ready", "failed") for b in buckets if b["warm"]):
            return
        time.sleep(0.5)
    raise TimeoutError(f"warm buckets of {names} did not settle in {timeout:g} s")
