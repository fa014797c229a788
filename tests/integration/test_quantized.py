"""A quantized model on a real server: ONNX Runtime serves it with its int8 kernels, and no TVM compile is
spent on its buckets (TVM would run its integer arithmetic in float: slower, and outside verification)."""

from __future__ import annotations

import numpy as np

from compiler.running.engines import OrtEngine
from tests.compiler.test_quantized import dynamic_quantized_encoder
from tests.integration.serverproc import ServerProcess, metric_value
from tests.integration.test_serving import predict, settled_bucket, upload

CONFIG = {"axes": {"batch": {"kind": "pow2", "min": 1, "max": 4}}, "warm_buckets": [{"x": [2, 16, 64]}]}


def test_a_quantized_models_buckets_are_not_compiled_and_onnxruntime_serves_them(tmp_path):
    data = dynamic_quantized_encoder(tmp_path)
    server = ServerProcess(tmp_path / "data", routing="compiled").start()
    try:
        with server.client() as client:
            assert upload(client, "int8", data, CONFIG).status_code == 201
            bucket = settled_bucket(client, "int8", "x=2x16x64")
            assert bucket["state"] == "failed"
            assert bucket["reason"].startswith("not compiled: a quantized graph (DynamicQuantizeLinear, MatMulInteger")
            assert bucket["reason"].endswith("onnxruntime serves it with its int8 kernels")
            assert bucket["openvino"] is None  # a server without OpenVINO (tests/conftest.py): as before it
            x = np.random.default_rng(3).standard_normal((2, 16, 64)).astype(np.float32)
            answer = predict(client, "int8", x)
            assert answer["engine"] == "onnxruntime"
            want = OrtEngine(data).run({"x": x})["y"]
            np.testing.assert_allclose(np.array(answer["outputs"]["y"], np.float32), want, rtol=1e-5, atol=1e-6)
            assert metric_value(client.get("/metrics").text, "jitserve_compiles_total", model="int8") == 0
    finally:
        server.stop()
