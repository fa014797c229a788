"""Compile admission against a real server with real (small) compiles: a
bucket compiles once it earns it, compile children run below serving, new
shapes run on the idle-priority cold lane, a shape storm is served by ONNX
Runtime without a compile, and every decision shows in ``GET /models/{name}``
and ``/metrics``."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import psutil

from compiler.models.demo import demo_model_bytes
from compiler.running.engines import OrtEngine
from tests.integration.serverproc import ServerProcess, metric_value, wait_until
from tests.integration.test_serving import settled_bucket, upload

DEMO = demo_model_bytes()
REFERENCE = OrtEngine(DEMO)
EXACT = {"axes": {"batch": {"kind": "exact"}}}


def x(n: int) -> np.ndarray:
    return np.linspace(-1, 1, n * 4, dtype=np.float32).reshape(n, 4)


def predict(client, n: int) -> dict:
    response = client.post("/predict", json={"model": "m", "inputs": {"x": x(n).tolist()}})
    assert response.status_code == 200, response.text
    body = response.json()
    np.testing.assert_allclose(body["outputs"]["probs"], REFERENCE.run({"x": x(n)})["probs"], rtol=1e-4, atol=1e-5)
    return body


def buckets(client) -> dict[str, dict]:
    return {b["bucket"]: b for b in client.get("/models/m").json()["buckets"]}


def compile_children_niceness(server: ServerProcess) -> set[int]:
    children = psutil.Process(server.process.pid).children(recursive=True)
    found = set()
    for child in children:
        try:
            if child.name().startswith(("python", "jitserve")) and "spawn" in " ".join(child.cmdline()):
                found.add(child.nice())
        except psutil.Error:
            pass
    return found


def thread_policies(pid: int) -> set[int]:
    """The scheduling policy of each of the process's threads (``/proc``'s stat, field 41)."""
    policies = set()
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:  # the thread ended
            continue
        policies.add(int(fields[41 - 3]))  # fields after the name start at field 3
    return policies


def test_admission_threshold_priority_and_storm(tmp_path):
    server = ServerProcess(
        tmp_path / "data",
        compile_min_hits=2,
        storm_new_buckets=3,
        tuning_enabled=False,
        compile_nice=12,
        routing="compiled",
        inline_max_ms=0,  # every run on a pool: the cold lane's count below is exact
    ).start()
    try:
        with server.client() as client:
            assert upload(client, "m", DEMO, EXACT).status_code == 201
            assert os.SCHED_IDLE not in thread_policies(server.process.pid)
            assert predict(client, 1)["engine"] == "onnxruntime"
            assert os.SCHED_IDLE in thread_policies(server.process.pid)  # the cold lane ran it
            first = buckets(client)["x=1x4"]
            assert (first["state"], first["reason"]) == ("cold", "cold: fewer than 2 requests within 60 s")
            predict(client, 1)  # earns its compile
            below = min(19, psutil.Process().nice() + 12)
            wait_until(lambda: below in compile_children_niceness(server), timeout=60, interval=0.02)
            assert settled_bucket(client, "m", "x=1x4")["state"] == "ready"
            assert predict(client, 1)["engine"] == "tvm"

            for n in range(2, 9):  # seven new shapes, each seen twice: a storm after the third
                predict(client, n)
                predict(client, n)
            described = client.get("/models/m").json()
            assert described["compile_admission"]["storm"] is True
            assert described["compile_admission"]["new_buckets_in_window"] == 8
            states = {b["bucket"]: b["state"] for b in described["buckets"]}
            stormed = [label for label, state in states.items() if state == "cold"]
            assert len(stormed) >= 5, states  # at most two new ones got in before the storm
            for label in stormed:
                assert buckets(client)[label]["reason"].startswith("cold: shape storm"), label
            metrics = client.get("/metrics").text
            assert metric_value(metrics, "jitserve_compile_admissions_total", model="m", reason="storm") >= 5
            assert metric_value(metrics, "jitserve_compile_admissions_total", decision="deferred") == 8
            assert metric_value(metrics, "jitserve_shape_storm", model="m") == 1
            # x=1x4 twice before its compile, each storm shape twice: all new, all on the cold lane
            assert metric_value(metrics, "jitserve_cold_lane_requests_total", model="m") == 2 + 7 * 2
            compiled = metric_value(metrics, "jitserve_compiles_total", model="m")
            assert compiled <= 3
            assert predict(client, 1)["engine"] == "tvm"  # the hot bucket keeps its kernel through the storm
    finally:
        server.stop()
