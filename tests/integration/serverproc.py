"""A real jitserve process on a free loopback port, for integration tests."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[2]
MARK = "JITSERVE_TEST_SERVER_MARK"
"""An environment variable each test server and every process it starts carries (replicas share a data
dir, so the dir alone does not tell one server's children from another's)."""
LEFTOVER_SECONDS = 8.0
"""How long after a server exits its children may take to follow it."""


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
        self.mark = uuid.uuid4().hex

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"JITSERVE_DATA_DIR": str(self.data_dir), "JITSERVE_PORT": str(self.port), MARK: self.mark})
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
                if httpx.get(f"{self.url}/healthz", timeout=1, verify=False).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server did not come up:\n{self.log()}")

    def stop(self) -> None:
        """Stop the server (if it still runs), then check that every process it started has exited within
        ``LEFTOVER_SECONDS``: one left is killed, and the test fails naming it."""
        stop_process(self.process)
        left = processes_marked(self.mark, LEFTOVER_SECONDS)
        if not left:
            return
        described = describe_processes(left)
        for process in left:
            with contextlib.suppress(psutil.Error):
                process.kill()
        raise AssertionError(f"the server's children outlived it by {LEFTOVER_SECONDS:g} s: {described}")

    def restart(self) -> ServerProcess:
        self.stop()
        self.port = free_port()
        return self.start()

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def client(self, **kwargs) -> httpx.Client:
        # Plain HTTP on loopback: no certificate to verify, and the CA bundle httpx loads for one took 45 ms
        # of CPU per client (the suite makes thousands: polls, hostile-input cases).
        return httpx.Client(base_url=self.url, timeout=120, **{"verify": False, **kwargs})


def stop_process(process: subprocess.Popen | None, timeout: float = 15) -> None:
    """SIGTERM, then SIGKILL past ``timeout``."""
    if process and process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def processes_marked(mark: str, wait: float = 0.0) -> list[psutil.Process]:
    """The live processes whose environment carries ``mark``, after waiting up to ``wait`` seconds for
    them to exit."""
    deadline = time.monotonic() + wait
    while True:
        found = []
        for process in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if process.environ().get(MARK) == mark and process.status() != psutil.STATUS_ZOMBIE:
                    found.append(process)
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.2)


def describe_processes(processes: list[psutil.Process]) -> str:
    described = []
    for process in processes:
        with contextlib.suppress(psutil.Error):
            command = " ".join(process.cmdline())[:160]
            described.append(f"pid {process.pid} ({process.status()}, parent {process.ppid()}): {command}")
    return "; ".join(described)


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


def delete_and_wait_released(client, model: str) -> None:
    """DELETE the model, then wait until the kernel cache holds nothing (a delete leaves nothing behind)."""
    assert client.delete(f"/models/{model}").status_code in (200, 204)
    wait_until(lambda: metric_value(client.get("/metrics").text, "jitserve_kernel_cache_entries") == 0,
               timeout=30, what="the cache emptied by the delete")  # fmt: skip
