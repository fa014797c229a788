"""Uploads that would cost without bound: a model with more symbolic axes than
the limit is refused at once, naming its count; under a raised limit, the
padding probe of a model with 2,000 stops at its time budget, holds up no other
upload while it runs, and ends at SIGTERM (its model is never stored)."""

from __future__ import annotations

import signal
import threading
import time

import httpx

from tests import synthetic
from tests.integration.serverproc import ServerProcess
from tests.integration.test_errors import assert_error
from tests.integration.test_serving import upload

AXES = 2000  # ~50 ms of probing per axis here: minutes for the whole model


def upload_in_background(server: ServerProcess, name: str, data: bytes) -> tuple[threading.Thread, list]:
    answers: list[httpx.Response | Exception] = []

    def send() -> None:
        try:
            with httpx.Client(base_url=server.url, timeout=120) as client:
                answers.append(upload(client, name, data))
        except httpx.HTTPError as exc:
            answers.append(exc)

    thread = threading.Thread(target=send)
    thread.start()
    return thread, answers


def test_a_long_probe_stops_at_its_budget_and_holds_up_no_other_upload(tmp_path):
    server = ServerProcess(tmp_path / "data", probe_seconds=4, compile_workers=0, max_symbolic_axes=AXES).start()
    try:
        thread, answers = upload_in_background(server, "wide", synthetic.many_inputs_model(AXES))
        time.sleep(0.5)
        with server.client() as client:
            assert upload(client, "small", synthetic.add_model()).status_code == 201
            assert thread.is_alive(), "the small upload waited for the wide model's probe"
            thread.join(120)
            assert answers[0].status_code == 201, answers[0].text
            axes = answers[0].json()["axes"]
            assert len(axes) == AXES
            out_of_time = [a for a in axes.values() if "ran out of its 4 s" in a["padding_safety"]["reason"]]
            assert 0 < len(out_of_time) < AXES
            assert all(a["effective_policy"] == "exact" for a in out_of_time)
            x = {f"x{i}": [[1.0, 2.0]] for i in range(AXES)}
            answer = client.post("/models/wide/predict", json={"inputs": x})
            assert answer.status_code == 200, answer.text
            assert answer.json()["outputs"]["y"] == [[AXES * 1.0, AXES * 2.0]]
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


def test_sigterm_ends_a_probe_and_its_model_is_not_stored(tmp_path):
    server = ServerProcess(
        tmp_path / "data", probe_seconds=600, shutdown_grace_seconds=1, max_symbolic_axes=AXES
    ).start()
    thread, answers = upload_in_background(server, "wide", synthetic.many_inputs_model(AXES))
    time.sleep(1.5)
    assert thread.is_alive()
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(30) in (0, -signal.SIGTERM)
    thread.join(30)
    # past the grace the connection is dropped; the probe ends at shutdown (tests/compiler/test_padding.py)
    assert answers and isinstance(answers[0], httpx.RemoteProtocolError), answers
    assert not (server.data_dir / "models" / "wide").exists()
    assert "Application shutdown complete" in server.log()
