"""Inputs real exported models take, against a real server under default
settings: a rank-0 (scalar) input and output, an axis the model refuses at
the default probe size, a zero-size batch."""

from __future__ import annotations

import numpy as np

from compiler.running.engines import OrtEngine
from tests import synthetic
from tests.integration.serverproc import ServerProcess
from tests.integration.test_serving import upload, wait_ready

AUDIO = synthetic.scalar_input_model(pad=64)


def test_a_scalar_input_model_uploads_and_serves_under_defaults(tmp_path):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 200)).astype(np.float32)
    want = OrtEngine(AUDIO).run({"x": x, "sr": np.array(8000, dtype=np.int64)})
    server = ServerProcess(tmp_path / "data", routing="compiled").start()
    try:
        with server.client() as client:
            assert upload(client, "vad", AUDIO).status_code == 201
            described = client.get("/models/vad").json()
            safety = {axis: entry["padding_safety"] for axis, entry in described["axes"].items()}
            assert safety["batch"]["safe"], safety
            # Refused at the default size 32 (reflect pad of 64): probed at a size the model accepts.
            assert not safety["samples"]["probe_failed"] and not safety["samples"]["safe"], safety
            body = {"model": "vad", "inputs": {"x": x.tolist(), "sr": 8000}}
            for engine in ("onnxruntime", "tvm"):
                response = client.post("/predict", json=body)
                assert response.status_code == 200, response.text
                answer = response.json()
                # samples: padding changes the outputs, so 200 is served by the kernel of its 4x range
                assert (answer["engine"], answer["bucket"]) == (engine, "sr=scalar,x=2xsamples@65..256")
                assert isinstance(answer["outputs"]["gain"], float) and answer["outputs"]["gain"] == 0.5
                np.testing.assert_allclose(answer["outputs"]["y"], want["y"], rtol=1e-5, atol=1e-6)
                if engine == "onnxruntime":
                    wait_ready(client, "vad", "sr=scalar,x=2xsamples@65..256")
            wrong = client.post("/predict", json={"model": "vad", "inputs": {"x": x.tolist(), "sr": [8000]}})
            assert wrong.status_code == 400 and "rank 1, expected 0" in wrong.json()["error"]
    finally:
        server.stop()


def test_a_zero_size_batch_is_served(tmp_path):
    data = synthetic.add_model()
    server = ServerProcess(tmp_path / "data", compile_workers=0).start()
    try:
        with server.client() as client:
            assert upload(client, "add", data).status_code == 201
            response = client.post("/predict", json={"model": "add", "inputs": {"x": []}})
            assert response.status_code == 200, response.text
            assert response.json()["outputs"]["y"] == []
    finally:
        server.stop()
