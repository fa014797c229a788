"""Real models of other kinds than OCR, as a new user brings them: uploaded
under default settings (no config), served 200 with ONNX Runtime's outputs,
and every compiled bucket verified or failed with a reason."""

from __future__ import annotations

import numpy as np
import pytest

from compiler.running.engines import OrtEngine
from tests.integration.serverproc import ServerProcess
from tests.integration.test_serving import probed, settled_bucket
from tests.realmodels import DETECTOR, MAGIKA, VAD, real_model


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = ServerProcess(tmp_path_factory.mktemp("real") / "data").start()
    yield server
    server.stop()


def serves_like_onnxruntime(client, name: str, data: bytes, inputs: dict, **tolerance) -> dict:
    body = {"model": name, "inputs": {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in inputs.items()}}
    response = client.post("/predict", json=body)
    assert response.status_code == 200, response.text
    arrays = {k: np.asarray(v, dtype=np.int64) if np.isscalar(v) else v for k, v in inputs.items()}
    want = OrtEngine(data).run(arrays)
    for output, value in want.items():
        np.testing.assert_allclose(response.json()["outputs"][output], value, **tolerance)
    return response.json()


def test_silero_vad_with_its_scalar_sample_rate(server):
    data = real_model(VAD).read_bytes()
    rng = np.random.default_rng(1)
    inputs = {"input": rng.standard_normal((1, 512)).astype(np.float32), "state": np.zeros((2, 1, 128), np.float32)}
    with server.client() as client:
        assert client.put("/models/vad", content=data).status_code == 201
        probed(client, "vad")  # its buckets compile once the padding probe's verdicts are in
        first = serves_like_onnxruntime(client, "vad", data, inputs | {"sr": 16000}, rtol=1e-5, atol=1e-6)
        assert first["engine"] == "onnxruntime"
        bucket = settled_bucket(client, "vad", timeout=300)
        assert bucket["state"] == "ready" or bucket["reason"], bucket  # TVM cannot import its sr-dependent pads
        at_8k = {"input": inputs["input"][:, :256], "state": inputs["state"], "sr": 8000}  # 256-sample windows
        serves_like_onnxruntime(client, "vad", data, at_8k, rtol=1e-4, atol=1e-5)
        wrong = client.post("/predict", json={"model": "vad", "inputs": {**inputs_json(inputs), "sr": [16000]}})
        assert wrong.status_code == 400 and "'sr' has rank 1, expected 0" in wrong.json()["error"]


def inputs_json(inputs: dict) -> dict:
    return {k: v.tolist() for k, v in inputs.items()}


def test_magika_bytes_classifier(server):
    data = real_model(MAGIKA).read_bytes()
    raw = np.frombuffer(b"#!/usr/bin/env python3\nprint('hello')\n" * 60, dtype=np.uint8)[:2048]
    inputs = {"bytes": np.stack([raw.astype(np.int32)] * 3)}
    with server.client() as client:
        assert client.put("/models/magika", content=data).status_code == 201
        described = probed(client, "magika")
        assert described["axes"]["unk__214"]["effective_policy"] == "pow2"  # batch padding checked safe
        serves_like_onnxruntime(client, "magika", data, inputs, rtol=1e-4, atol=1e-5)
        bucket = settled_bucket(client, "magika", timeout=300)
        assert bucket["state"] == "ready", bucket  # a verified kernel, timed against ONNX Runtime
        assert set(bucket["latency_ms"]) == {"onnxruntime", "tvm"}
        answer = serves_like_onnxruntime(client, "magika", data, inputs, rtol=1e-3, atol=1e-4)
        assert answer["engine"] == bucket["engine"]


@pytest.mark.slow
def test_yolov8n_detector(server):
    data = real_model(DETECTOR).read_bytes()
    image = np.random.default_rng(2).random((1, 3, 320, 320)).astype(np.float32)
    config = '{"warm_buckets": [{"images": [1, 3, 320, 320]}]}'
    with server.client() as client:
        response = client.put("/models/detector", files={"model": ("320n.onnx", data), "config": (None, config)})
        assert response.status_code == 201, response.text
        probed(client, "detector")
        serves_like_onnxruntime(client, "detector", data, {"images": image}, rtol=1e-3, atol=1e-3)
        bucket = settled_bucket(client, "detector", timeout=300)
        assert bucket["state"] == "ready", bucket
        serves_like_onnxruntime(client, "detector", data, {"images": image}, rtol=1e-3, atol=1e-2)
