"""A TVM RPC tracker and RPC servers on loopback: the fleet distributed
tuning measures on (``python -m tvm.exec.rpc_tracker`` / ``rpc_server``)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.integration.serverproc import free_port


class RpcFleet:
    """A tracker and ``servers`` RPC servers registered under ``key``; each in its own process group (the
    CLIs run the real server in a child that outlives a killed parent)."""

    def __init__(self, log_dir: Path, servers: int = 2, key: str = "jitserve") -> None:
        self.log_dir = log_dir
        self.count = servers
        self.key = key
        self.port = free_port()
        self.processes: list[subprocess.Popen] = []

    @property
    def tracker(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _spawn(self, name: str, *args: str) -> None:
        log = open(self.log_dir / f"{name}.log", "w")  # noqa: SIM115 - lives as long as the process
        self.processes.append(
            subprocess.Popen(
                [sys.executable, "-m", *args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        )

    def start(self, timeout: float = 60) -> RpcFleet:
        port = str(self.port)
        self._spawn(
            "tracker", "tvm.exec.rpc_tracker", "--host", "127.0.0.1", "--port", port, "--port-end", str(self.port + 1)
        )
        deadline = time.monotonic() + timeout
        while not _listening(self.port):  # servers started before the tracker listens retry only every 5 s
            if time.monotonic() > deadline:
                raise TimeoutError(f"RPC tracker did not listen:\n{self.log('tracker')}")
            time.sleep(0.1)
        for index in range(self.count):
            server_port = free_port()
            self._spawn(
                f"server{index}", "tvm.exec.rpc_server", "--tracker", self.tracker, "--key", self.key,
                "--host", "127.0.0.1", "--port", str(server_port), "--port-end", str(server_port + 1),
            )  # fmt: skip
        while self.free_servers() < self.count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"RPC servers did not register:\n{self.log('server0')}")
            time.sleep(0.2)
        return self

    def free_servers(self) -> int:
        import tvm

        try:
            summary = tvm.rpc.connect_tracker("127.0.0.1", self.port).summary()
        except Exception:  # noqa: BLE001 - not up yet
            return 0
        return int(summary["queue_info"].get(self.key, {}).get("free", 0))

    def log(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text() if path.exists() else ""

    def measurements(self) -> list[int]:
        """Per server, how many candidate kernels it loaded (one per measurement)."""
        return [self.log(f"server{index}").count("load_module") for index in range(self.count)]

    def stop(self) -> None:
        for process in self.processes:  # the group: the parent may be gone and its server child not
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0
