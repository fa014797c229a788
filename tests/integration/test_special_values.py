"""Special values against a real server whose bucket a verified TVM kernel
serves: inputs that are not finite or past ``kernel_input_max_abs`` are
answered by ONNX Runtime, bit for bit, and JSON writes non-finite outputs as
null (binary V2 outputs carry them as they are)."""

from __future__ import annotations

import numpy as np
import orjson

from compiler.models.demo import demo_model_bytes
from compiler.running.engines import OrtEngine
from loadtest.compare import v2_binary_body
from tests.integration.serverproc import ServerProcess, metric_value
from tests.integration.test_serving import upload, wait_ready

DEMO = demo_model_bytes()
CONFIG = {"axes": {"batch": {"kind": "exact"}}, "warm_buckets": [{"x": [2, 4]}]}


def binary_infer(client, x: np.ndarray) -> np.ndarray:
    body, head_length = v2_binary_body("x", x)
    headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(head_length)}
    response = client.post("/v2/models/m/infer", content=body, headers=headers)
    assert response.status_code == 200, response.text
    head = int(response.headers["Inference-Header-Content-Length"])
    output = orjson.loads(response.content[:head])["outputs"][0]
    return np.frombuffer(response.content[head:], dtype=np.float32).reshape(output["shape"])


def test_special_values_are_answered_by_onnxruntime_and_nan_is_null_in_json(tmp_path):
    reference = OrtEngine(DEMO)
    server = ServerProcess(tmp_path / "data", routing="compiled", tuning_enabled=False).start()
    try:
        with server.client() as client:
            assert upload(client, "m", DEMO, CONFIG).status_code == 201
            wait_ready(client, "m", "x=2x4")
            ordinary = [[0.5, -1.0, 2.0, 0.0], [1.0, 1.0, 1.0, 1.0]]
            assert client.post("/models/m/predict", json={"inputs": {"x": ordinary}}).json()["engine"] == "tvm"

            huge = [[3e38] * 4, [1.0] * 4]
            answer = client.post("/models/m/predict", json={"inputs": {"x": huge}}).json()
            assert answer["engine"] == "onnxruntime"
            want = reference.run({"x": np.asarray(huge, dtype=np.float32)})["probs"]
            assert not np.isfinite(want[0]).all()  # the reference overflows: NaN
            assert answer["outputs"]["probs"][0] == [None if not np.isfinite(v) else v for v in want[0].tolist()]

            for special in (np.nan, np.inf, -np.inf, 2e6):
                x = np.ones((2, 4), dtype=np.float32)
                x[1, 2] = special
                got = binary_infer(client, x)
                np.testing.assert_array_equal(got, reference.run({"x": x})["probs"])  # NaN where it is NaN
            text = client.get("/metrics").text
            assert metric_value(text, "jitserve_requests_total", model="m", engine="onnxruntime", code="200") == 5
    finally:
        server.stop()
