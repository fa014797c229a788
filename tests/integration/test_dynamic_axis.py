"""The dynamic-shape tier on a real server with a real compile: an axis whose
padding would change the outputs, declared ``dynamic``, is served within its
range by one symbolic kernel (verified against ONNX Runtime at the range's
ends and middle, timed against it like every tier); sizes outside the range
get buckets of their own."""

from __future__ import annotations

import numpy as np

from compiler.engines import OrtEngine
from tests import synthetic
from tests.integration.serverproc import ServerProcess
from tests.integration.test_serving import settled_bucket, upload

MODEL = synthetic.mean_mix_model(weight=1.0)  # y = x + mean(x over W): padding W changes every output
REFERENCE = OrtEngine(MODEL)
CONFIG = {"axes": {"W": {"kind": "dynamic", "min": 8, "max": 256}}}


def predict(client, width: int) -> dict:
    x = np.random.default_rng(width).standard_normal((1, 8, width)).astype(np.float32)
    response = client.post("/predict", json={"model": "m", "inputs": {"x": x.tolist()}})
    assert response.status_code == 200, response.text
    body = response.json()
    np.testing.assert_allclose(body["outputs"]["y"], REFERENCE.run({"x": x})["y"], rtol=1e-4, atol=1e-5)
    return body


def test_one_symbolic_kernel_serves_every_width_of_its_range(tmp_path):
    server = ServerProcess(tmp_path / "data", tuning_enabled=False, routing="compiled").start()
    try:
        with server.client() as client:
            assert upload(client, "m", MODEL, CONFIG).status_code == 201
            described = client.get("/models/m").json()
            axis = described["axes"]["W"]
            assert axis["effective_policy"] == "dynamic", axis
            assert "one symbolic kernel serves 8..256" in axis["padding_safety"]["reason"], axis

            first = predict(client, 9)
            assert (first["bucket"], first["engine"]) == ("x=1x8xW", "onnxruntime")  # served while it compiles
            bucket = settled_bucket(client, "m", "x=1x8xW")
            assert bucket["state"] == "ready", bucket
            assert bucket["shapes"] == {"x": [1, 8, "W"]}
            assert set(bucket["latency_ms"]) == {"onnxruntime", "tvm"}  # timed against ONNX Runtime
            for width in (8, 9, 77, 200, 256):  # one bucket, one kernel, no padding
                body = predict(client, width)
                assert (body["bucket"], body["engine"]) == ("x=1x8xW", "tvm"), width

            outside = predict(client, 300)
            assert outside["bucket"] == "x=1x8x300"
            labels = {b["bucket"] for b in client.get("/models/m").json()["buckets"]}
            assert labels == {"x=1x8xW", "x=1x8x300"}
    finally:
        server.stop()
