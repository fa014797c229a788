"""The padding probe runs after the upload answers: meanwhile ONNX Runtime serves every request at its exact
shape and nothing compiles; its verdicts then go into the served model and its record, and the warm buckets
compile. A model deleted during its probe leaves nothing behind, and the probe never writes over the record
of a version uploaded after it."""

from __future__ import annotations

import json

import numpy as np

from compiler.running.engines import OrtEngine
from compiler.shapes.padding import PROBE_VERSION
from tests import synthetic
from tests.integration.serverproc import ServerProcess, metric_value, wait_until
from tests.integration.test_serving import predict, probed, upload, wait_ready

MODEL = synthetic.slow_model(layers=4, compilable=True)
# Probed at 2048 rows padded to 4096, confirmed at 6144 -> 8192: about 3 s of ONNX Runtime on two cores.
SLOW_PROBE = {"axes": {"batch": {"kind": "pow2", "min": 1, "max": 8192}}, "probe_sizes": {"batch": 2048}}
WARM = SLOW_PROBE | {"warm_buckets": [{"x": [3, 4]}]}


def rows(n: int) -> np.ndarray:
    return np.linspace(-1, 1, n * 4, dtype=np.float32).reshape(n, 4)


def test_an_upload_answers_before_its_probe_ends_and_the_warm_buckets_compile_after_it(tmp_path):
    reference = OrtEngine(MODEL)
    server = ServerProcess(tmp_path / "data", routing="compiled", tuning_enabled=False).start()
    try:
        with server.client() as client:
            response = upload(client, "slow", MODEL, WARM, wait_probe=False)
            assert response.status_code == 201, response.text
            assert response.json()["padding_probe"]["state"] in ("pending", "running")

            during = predict(client, "slow", rows(3))
            described = client.get("/models/slow").json()
            assert described["padding_probe"]["state"] == "running"  # so the request above was answered during it
            assert (during["engine"], during["bucket"]) == ("onnxruntime", "x=3x4")  # exact: nothing padded
            np.testing.assert_allclose(during["outputs"]["y"], reference.run({"x": rows(3)})["y"], rtol=1e-5)
            batch = described["axes"]["batch"]
            assert (batch["padding_safety"], batch["effective_policy"]) == (None, "exact")
            [exact] = described["buckets"]  # no warm bucket before the verdicts say which bucket it is
            assert (exact["state"], exact["warm"]) == ("cold", False)
            assert exact["reason"] == "cold: waiting for the padding probe's verdicts"
            assert client.get("/readyz").status_code == 200  # a model uploaded later never takes it out

            done = probed(client, "slow")
            assert done["padding_probe"]["seconds"] > 0.5
            batch = done["axes"]["batch"]
            assert batch["padding_safety"]["safe"] and batch["effective_policy"] == "pow2", batch
            assert batch["padding_safety"]["reason"] == "outputs match after padding 2048 -> 4096"
            assert {b["bucket"]: b["warm"] for b in done["buckets"]} == {"x=3x4": False, "x=4x4": True}
            record = json.loads((server.data_dir / "models" / "slow" / "v1" / "record.json").read_text())
            assert record["probe_version"] == PROBE_VERSION and record["safety"]["batch"]["safe"]

            wait_ready(client, "slow", "x=4x4")
            after = predict(client, "slow", rows(3))
            assert (after["engine"], after["bucket"]) == ("tvm", "x=4x4")  # padded now, cut back
            np.testing.assert_allclose(after["outputs"]["y"], reference.run({"x": rows(3)})["y"], rtol=1e-4, atol=1e-5)
            buckets = {b["bucket"]: b["state"] for b in client.get("/models/slow").json()["buckets"]}
            assert buckets == {"x=3x4": "cold", "x=4x4": "ready"}  # the exact bucket was never compiled
            text = client.get("/metrics").text
            assert metric_value(text, "jitserve_padding_probe_seconds_count", model="slow", outcome="done") == 1
            deferred = metric_value(text, "jitserve_compile_admissions_total", model="slow", reason="padding_probe")
            assert deferred == 1

        server.restart()  # the stored verdicts are served at once: no probe runs again
        with server.client() as client:
            described = client.get("/models/slow").json()
            assert described["padding_probe"] == {"state": "done", "seconds": None, "error": None}
            assert described["axes"]["batch"]["effective_policy"] == "pow2"
    finally:
        server.stop()


def test_a_model_deleted_during_its_probe_leaves_nothing_behind(tmp_path):
    server = ServerProcess(tmp_path / "data", compile_workers=0).start()
    try:
        with server.client() as client:
            response = upload(client, "gone", MODEL, SLOW_PROBE, wait_probe=False)
            assert response.status_code == 201, response.text
            wait_until(lambda: client.get("/models/gone").json()["padding_probe"]["state"] == "running", timeout=30)
            assert client.delete("/models/gone").status_code == 204
            assert client.get("/models/gone").status_code == 404
            assert not (server.data_dir / "models" / "gone").exists()

            # The same name again takes version 1 again: the deleted version's probe must not touch its record.
            exact = {"axes": {"batch": {"kind": "exact"}}}
            assert upload(client, "gone", MODEL, exact).status_code == 201
            wait_until(lambda: "model gone v1: padding probe stopped" in server.log(), timeout=60)
            described = client.get("/models/gone").json()
            assert described["version"] == 1 and described["padding_probe"]["state"] == "done"
            assert described["axes"]["batch"]["padding_safety"]["reason"] == "policy is exact: never padded"
            record = json.loads((server.data_dir / "models" / "gone" / "v1" / "record.json").read_text())
            assert record["safety"]["batch"]["reason"] == "policy is exact: never padded"
            assert record["config"]["axes"]["batch"]["kind"] == "exact"
            answer = predict(client, "gone", rows(2))
            assert (answer["engine"], answer["bucket"]) == ("onnxruntime", "x=2x4")
            assert metric_value(client.get("/metrics").text, "jitserve_padding_probe_seconds_count") == 0
            assert client.get("/healthz").status_code == 200
    finally:
        server.stop()


def test_a_probe_that_fails_leaves_its_axes_unpadded_and_the_server_serving(tmp_path):
    server = ServerProcess(tmp_path / "data", compile_workers=0).start()
    try:
        with server.client() as client:
            assert upload(client, "add", synthetic.add_model(), {"probe_sizes": {"batch": 4096}}).status_code == 201
        server.stop()
        # Stored before its probe ended, then served under a tensor limit its probe sizes are over: the probe
        # run at the next start raises.
        path = server.data_dir / "models" / "add" / "v1" / "record.json"
        record = json.loads(path.read_text())
        path.write_text(json.dumps(record | {"probe_version": 0}))
        server.settings["max_tensor_bytes"] = 16384
        server.start()
        with server.client() as client:
            probe = wait_until(
                lambda: (
                    (p := client.get("/models/add").json()["padding_probe"])["state"] not in ("pending", "running")
                    and p
                ),
                timeout=60,
            )
            assert probe["state"] == "failed" and "over the largest tensor served (16384 bytes)" in probe["error"]
            batch = client.get("/models/add").json()["axes"]["batch"]
            assert batch["effective_policy"] == "exact" and not batch["padding_safety"]["probed"], batch
            assert batch["padding_safety"]["reason"].startswith("the padding probe failed (BadRequestError: config")
            answer = predict(client, "add", rows(3))
            assert (answer["engine"], answer["bucket"]) == ("onnxruntime", "x=3x4")  # exact: nothing padded
            np.testing.assert_allclose(answer["outputs"]["y"], 2 * rows(3))
            text = client.get("/metrics").text
            assert metric_value(text, "jitserve_padding_probe_seconds_count", model="add", outcome="failed") == 1
            assert "model add v1: the padding probe failed" in server.log()
        assert json.loads(path.read_text())["probe_version"] == 0  # a failed probe's verdicts are not stored
    finally:
        server.stop()
