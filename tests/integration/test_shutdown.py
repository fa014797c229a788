"""SIGTERM: requests in flight finish, new ones are refused, compile children
are gone, and the process exits on its own (``stop_children`` itself is
tested in tests/compiler/test_worker.py)."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import numpy as np
import psutil
import pytest

from compiler.models.demo import demo_model_bytes
from tests import synthetic
from tests.integration.serverproc import ServerProcess, wait_until
from tests.integration.test_crash import WARM, compile_children
from tests.integration.test_serving import upload

EXACT = {"axes": {"batch": {"kind": "exact"}}}
ROWS = 4096  # ~1.4 s of ONNX Runtime on two cores: long enough to be in flight at the signal


def test_sigterm_finishes_requests_in_flight_and_stops_compile_children(tmp_path):
    server = ServerProcess(tmp_path / "data", tuning_enabled=False, shutdown_grace_seconds=30).start()
    answers: list[httpx.Response] = []
    with server.client() as client:
        assert upload(client, "slow", synthetic.slow_model(), EXACT).status_code == 201
        x = np.full((ROWS, 4), 0.5, dtype=np.float32).tolist()
        client.post("/models/slow/predict", json={"inputs": {"x": x[:1]}}).raise_for_status()
        assert upload(client, "m", demo_model_bytes(), WARM).status_code == 201
        # its compile child: a fresh interpreter importing TVM, seconds before it could finish
        children = wait_until(lambda: compile_children(server.process.pid), timeout=60, interval=0.01)

        def slow_request() -> None:
            with httpx.Client(base_url=server.url, timeout=60) as own:
                answers.append(own.post("/models/slow/predict", json={"inputs": {"x": x}}))

        in_flight = threading.Thread(target=slow_request)
        in_flight.start()
        time.sleep(0.5)
        server.process.send_signal(signal.SIGTERM)
        in_flight.join(60)
    assert answers and answers[0].status_code == 200, answers
    assert len(answers[0].json()["outputs"]["y"]) == ROWS
    # uvicorn raises the signal again once it has shut down cleanly: the exit says what stopped it
    assert server.process.wait(30) in (0, -signal.SIGTERM)
    assert "Application shutdown complete" in server.log()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/healthz", timeout=2)
    # stopped by the shutdown, or by their own parent-death signal had the compile outlived it
    assert not [child for child in children if child.is_running() and child.status() != psutil.STATUS_ZOMBIE]
