"""Verdicts that hold for what they were judged at: a kernel failing
verification leaves its bucket failed with the reason while ONNX Runtime
keeps serving, and new tolerances get a verdict of their own."""

from __future__ import annotations

import numpy as np

from compiler.running.engines import OrtEngine
from tests import synthetic
from tests.integration.serverproc import ServerProcess, metric_value
from tests.integration.test_serving import settled_bucket, upload

ENCODER = synthetic.bert_encoder_model(layers=1, hidden=64, heads=2, seq=16)
BUCKET = "x=1x16x64"
STRICT = {"rtol": 1e-12, "atol": 1e-12}  # TVM's float32 sums differ from ONNX Runtime's by ~1e-6


def test_a_failed_verification_keeps_onnxruntime_serving_and_tolerances_get_their_own_verdict(tmp_path):
    x = np.random.default_rng(3).standard_normal((1, 16, 64)).astype(np.float32)
    want = OrtEngine(ENCODER).run({"x": x})["y"]
    config = {"warm_buckets": [{"x": [1, 16, 64]}], "probe_sizes": {"batch": 2}}
    server = ServerProcess(tmp_path / "data", routing="compiled").start()
    try:
        with server.client() as client:
            assert upload(client, "enc", ENCODER, config | STRICT).status_code == 201
            bucket = settled_bucket(client, "enc", BUCKET)
            assert bucket["state"] == "failed"
            assert bucket["reason"].startswith("verification against onnxruntime: output 'y' differs by up to")
            answer = client.post("/predict", json={"model": "enc", "inputs": {"x": x.tolist()}}).json()
            assert answer["engine"] == "onnxruntime"
            np.testing.assert_allclose(answer["outputs"]["y"], want, rtol=1e-5, atol=1e-5)
            text = client.get("/metrics").text
            assert metric_value(text, "jitserve_compiles_total", model="enc", outcome="verify_failed") == 1

            # Looser tolerances: judged again, not handed the stored failure.
            assert upload(client, "enc", ENCODER, config, replace="true").status_code == 201
            assert settled_bucket(client, "enc", BUCKET)["state"] == "ready"
            answer = client.post("/predict", json={"model": "enc", "inputs": {"x": x.tolist()}}).json()
            assert answer["engine"] == "tvm"
            np.testing.assert_allclose(answer["outputs"]["y"], want, rtol=1e-3, atol=1e-4)

            # Strict again: not handed the looser run's "verified".
            assert upload(client, "enc", ENCODER, config | STRICT, replace="true").status_code == 201
            assert settled_bucket(client, "enc", BUCKET)["state"] == "failed"
            text = client.get("/metrics").text
            assert metric_value(text, "jitserve_compiles_total", model="enc", outcome="ok") == 1
    finally:
        server.stop()
