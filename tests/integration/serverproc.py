"""A real jitserve process on a free loopback port, for integration tests."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """``python -m server`` with ``JITSERVE_*`` settings; restartable on the same data dir."""

    def __init__(self, data_dir: Path, **settings) -> None:
        self.data_dir = data_dir
        self.settings = settings
        self.port = free_port()
        self.process: subprocess.Popen | None = None
        self.log_path = data_dir.parent / f"server-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"JITSERVE_DATA_DIR": str(self.data_dir), "JITSERVE_PORT": str(self.port)})
        env.setdefault("JITSERVE_DEMO_MODEL", "false")
        # Tests that watch a compile start it with one request; admission's own tests raise this.
        env.setdefault("JITSERVE_COMPILE_MIN_HITS", "1")
        for key, value in self.settings.items():
            env[f"JITSERVE_{key.upper()}"] = value if isinstance(value, str) else json.dumps(value)
        return env

    def start(self, timeout: float = 60) -> ServerProcess:
        log = open(self.log_path, "a")  # noqa: SIM115 - lives as long as the process
        self.process = subprocess.Popen(
            [sys.executable, "-m", "server"], cwd=REPO, env=self.env(), stdout=log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server did not come up:\n{self.log()}")

    def stop(self) -> None:
        stop_process(self.process)

    def restart(self) -> ServerProcess:
        self.stop()
        self.port = free_port()
        return self.start()

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120, **kwargs)


def stop_process(process: subprocess.Popen | None, timeout: float = 15) -> None:
    """SIGTERM, then SIGKILL past ``timeout``."""
    if process and process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def variant(data: bytes, text: str) -> bytes:
    """The same graph with a different doc string: new bytes, a new digest, a new model version."""
    import onnx

    model = onnx.load_from_string(data)
    model.doc_string = text
    return model.SerializeToString()


def new_graph_variant(data: bytes, text: str) -> bytes:
    """A new version whose graph differs (its first output passes through one more node, an Identity),
    so every bucket gets a new kernel key and compiles again."""
    import onnx
    from onnx import helper

    model = onnx.load_from_string(variant(data, text))
    output = model.graph.output[0].name
    for node in model.graph.node:
        node.output[:] = [f"{output}_before_identity" if name == output else name for name in node.output]
    model.graph.node.append(helper.make_node("Identity", [f"{output}_before_identity"], [output]))
    return model.SerializeToString()


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def wait_until(predicate, timeout: float = 180, interval: float = 0.25, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out waiting for {what}")
