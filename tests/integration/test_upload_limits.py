"""Uploads that would cost without bound: a model with more symbolic axes than
the limit is refused at once, naming its count; under a raised limit, the
padding probe of a model with 2,000 runs after its upload answered, holds up
no other upload or probe, stops at its time budget, and ends at SIGTERM (the
next start probes the model again)."""

from __future__ import annotations

import json
import signal
import time

from compiler.shapes.padding import PROBE_VERSION
from tests import synthetic
from tests.integration.serverproc import ServerProcess, wait_until
from tests.integration.test_errors import assert_error
from tests.integration.test_serving import probed, upload

AXES = 2000  # ~50 ms of probing per axis here: minutes for the whole model
WIDE_INPUTS = {f"x{i}": [[1.0, 2.0]] for i in range(AXES)}


def probe_state(client, name: str) -> str:
    return client.get(f"/models/{name}").json()["padding_probe"]["state"]


def out_of_time(described: dict, seconds: int) -> list[dict]:
    return [a for a in described["axes"].values() if f"ran out of its {seconds} s" in a["padding_safety"]["reason"]]


def test_a_long_probe_runs_after_the_upload_answered_and_stops_at_its_budget(tmp_path):
    server = ServerProcess(tmp_path / "data", probe_seconds=4, compile_workers=0, max_symbolic_axes=AXES).start()
    try:
        with server.client() as client:
            response = upload(client, "wide", synthetic.many_inputs_model(AXES), wait_probe=False)
            assert response.status_code == 201, response.text
            assert response.json()["padding_probe"]["state"] in ("pending", "running")
            assert upload(client, "small", synthetic.add_model()).status_code == 201  # and its probe done
            assert probe_state(client, "wide") == "running", "the small model waited for the wide one's probe"
            answer = client.post("/models/wide/predict", json={"inputs": WIDE_INPUTS})  # served during the probe
            assert answer.status_code == 200, answer.text
            assert answer.json()["outputs"]["y"] == [[AXES * 1.0, AXES * 2.0]]

            described = probed(client, "wide")
            assert len(described["axes"]) == AXES
            assert 4 <= described["padding_probe"]["seconds"] < 60
            late = out_of_time(described, 4)
            assert 0 < len(late) < AXES
            assert all(a["effective_policy"] == "exact" for a in late)
    finally:
        server.stop()


def test_a_model_past_the_symbolic_axis_limit_is_refused_at_once(tmp_path):
    server = ServerProcess(tmp_path / "data", compile_workers=0).start()  # the default limit, 256
    try:
        with server.client() as client:
            started = time.monotonic()
            refused = upload(client, "wide", synthetic.many_inputs_model(AXES))
            assert time.monotonic() - started < 10
            assert_error(refused, 400, "the model has 2000 symbolic axes; at most 256 are served (max_symbolic_axes)")
            assert client.get("/models/wide").status_code == 404
    finally:
        server.stop()


def test_sigterm_ends_a_probe_and_the_next_start_probes_again(tmp_path):
    server = ServerProcess(
        tmp_path / "data", probe_seconds=600, shutdown_grace_seconds=1, compile_workers=0, max_symbolic_axes=AXES
    ).start()
    try:
        with server.client() as client:
            response = upload(client, "wide", synthetic.many_inputs_model(AXES), wait_probe=False)
            assert response.status_code == 201, response.text
            wait_until(lambda: probe_state(client, "wide") == "running", timeout=30)
        time.sleep(1)
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(30) in (0, -signal.SIGTERM)
        assert time.monotonic() - signalled < 15  # not the minutes the probe had left
        assert "Application shutdown complete" in server.log()
        path = server.data_dir / "models" / "wide" / "v1" / "record.json"
        assert json.loads(path.read_text())["probe_version"] == 0  # stored, not probed yet

        server.settings["probe_seconds"] = 2
        server.restart()
        with server.client() as client:
            described = probed(client, "wide")  # probed again, in the background of the start
            assert 0 < len(out_of_time(described, 2)) < AXES
        assert json.loads(path.read_text())["probe_version"] == PROBE_VERSION
    finally:
        server.stop()
