"""Large request bodies against a real server: parsed in a child process with
the same answers and errors as small ones, and held within the body budget
(loadtest/big_bodies.py measures /healthz and RSS under many of them)."""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import orjson
import psutil
import pytest

from tests import synthetic
from tests.integration.serverproc import (
    LEFTOVER_SECONDS,
    ServerProcess,
    describe_processes,
    processes_marked,
    wait_until,
)
from tests.integration.test_errors import assert_error
from tests.integration.test_serving import settled_bucket, upload

ROWS = 40_000  # ~3 MiB of JSON: past the size parsed in a child process


def test_large_bodies_are_parsed_in_a_child_with_the_same_answers_and_errors(tmp_path):
    server = ServerProcess(tmp_path / "data", compile_workers=0).start()
    try:
        with server.client() as client:
            assert upload(client, "add", synthetic.add_model()).status_code == 201
            x = np.random.default_rng(0).standard_normal((ROWS, 4)).astype(np.float32)
            body = orjson.dumps({"inputs": {"x": x.tolist()}})
            assert len(body) > 2 * 1024 * 1024
            answer = client.post("/models/add/predict", content=body)
            assert answer.status_code == 200, answer.text
            np.testing.assert_array_equal(np.asarray(answer.json()["outputs"]["y"], dtype=np.float32), x + x)
            ragged = orjson.dumps({"inputs": {"x": [*x.tolist(), [1.0]]}})
            assert_error(client.post("/models/add/predict", content=ragged), 400, "input 'x' is ragged")
            text = orjson.dumps({"inputs": {"x": [["a"] * 4] * ROWS}})
            assert_error(client.post("/models/add/predict", content=text), 400, "input 'x' must be numeric")
            assert_error(client.post("/models/add/predict", content=body[:-1]), 400, "malformed JSON")
            children = psutil.Process(server.process.pid).children()
            assert any("multiprocessing" in " ".join(child.cmdline()) for child in children), "no parser process"
    finally:
        server.stop()


def test_a_body_past_the_budget_waits_then_answers_503(tmp_path):
    server = ServerProcess(
        tmp_path / "data", compile_workers=0, max_body_bytes_in_flight=1024 * 1024, body_wait_seconds=0.5
    ).start()
    body = orjson.dumps({"inputs": {"x": [[1.0, 2.0, 3.0, 4.0]]}})
    answers: list[httpx.Response] = []

    def slow_chunks():
        # chunked: no declared length, so it holds the whole predict limit (16 MiB) while it arrives
        for index in range(0, len(body), 4):
            time.sleep(2.5 / len(body) * 4)
            yield body[index : index + 4]

    def slow_request() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as own:
            answers.append(own.post("/models/add/predict", content=slow_chunks()))

    try:
        with server.client() as client:
            assert upload(client, "add", synthetic.add_model()).status_code == 201
            slow = threading.Thread(target=slow_request)
            slow.start()
            time.sleep(0.8)
            assert_error(client.post("/models/add/predict", content=body), 503, "request bodies in flight", "budget")
            slow.join(30)
            assert answers[0].status_code == 200, answers[0].text
            assert client.post("/models/add/predict", content=body).status_code == 200
    finally:
        server.stop()


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGKILL"])
def test_no_child_outlives_a_server_that_parsed_and_compiled(tmp_path, stop):
    server = ServerProcess(tmp_path / "data").start()
    try:
        with server.client() as client:
            assert upload(client, "add", synthetic.add_model()).status_code == 201
            x = np.random.default_rng(1).standard_normal((ROWS, 4)).astype(np.float32)
            assert client.post("/models/add/predict", content=orjson.dumps({"inputs": {"x": x.tolist()}})).is_success
            small = {"inputs": {"x": [[1.0, 2.0, 3.0, 4.0]]}}
            assert client.post("/models/add/predict", json=small).is_success  # its bucket compiles
            wait_until(lambda: settled_bucket(client, "add", "x=1x4")["state"] == "ready", what="compiled")
            started = psutil.Process(server.process.pid).children(recursive=True)
            parsers = [p for p in started if "multiprocessing-fork" in " ".join(p.cmdline())]
            assert parsers, describe_processes(started)
        if stop == "SIGKILL":
            server.process.kill()
        else:
            server.process.terminate()
        server.process.wait(30)
        # every process the server started, by the mark in its environment: none left within 8 s
        assert processes_marked(server.mark, LEFTOVER_SECONDS) == []
    finally:
        server.stop()
