"""A dynamically quantized model on a real server. Where the compiled tier's exact integer kernels can
verify against ONNX Runtime (7-bit weights, which ONNX Runtime's AVX2 kernels multiply without saturating,
or an owner's contract that allows int8 within a budget), its buckets are compiled, verified and timed
beside ONNX Runtime. Otherwise no compile is spent, and ONNX Runtime serves with its int8 kernels."""

from __future__ import annotations

import numpy as np

from compiler.building.matrix_units import host_matrix_units
from compiler.running.engines import OrtEngine
from tests.compiler.test_quantized import dynamic_quantized_encoder
from tests.integration.serverproc import ServerProcess, metric_value
from tests.integration.test_serving import predict, settled_bucket, upload

CONFIG = {"axes": {"batch": {"kind": "pow2", "min": 1, "max": 4}}, "warm_buckets": [{"x": [2, 16, 64]}]}
_X = np.random.default_rng(3).standard_normal((2, 16, 64)).astype(np.float32)


def test_a_quantized_model_is_compiled_only_where_its_kernels_can_verify(tmp_path):
    eight_bit = dynamic_quantized_encoder(tmp_path)
    seven_bit = dynamic_quantized_encoder(tmp_path, reduce_range=True)
    exact_peer = host_matrix_units().unit("int8") != "avx2"  # ONNX Runtime on VNNI or AMX: no saturation
    server = ServerProcess(tmp_path / "data", routing="compiled").start()
    try:
        with server.client() as client:
            assert upload(client, "int8", eight_bit, CONFIG).status_code == 201
            bucket = settled_bucket(client, "int8", "x=2x16x64")
            if not exact_peer:
                assert bucket["state"] == "failed"
                assert bucket["reason"].startswith(
                    "not compiled: a quantized graph (DynamicQuantizeLinear, MatMulInteger"
                )
                assert "saturate" in bucket["reason"] and "precision contract that allows int8" in bucket["reason"]
                assert bucket["reason"].endswith("onnxruntime serves it with its int8 kernels")
                assert bucket["openvino"] is None  # a server without OpenVINO (tests/conftest.py)
                answer = predict(client, "int8", _X)
                assert answer["engine"] == "onnxruntime"
                want = OrtEngine(eight_bit).run({"x": _X})["y"]
                np.testing.assert_allclose(np.array(answer["outputs"]["y"], np.float32), want, rtol=1e-5, atol=1e-6)
                assert metric_value(client.get("/metrics").text, "jitserve_compiles_total", model="int8") == 0

            # 7-bit weights: exact in both engines, verified at fp32's tolerances, no contract needed.
            assert upload(client, "int7", seven_bit, CONFIG).status_code == 201
            bucket = settled_bucket(client, "int7", "x=2x16x64")
            assert bucket["state"] == "ready" and set(bucket["latency_ms"]) == {"onnxruntime", "tvm"}, bucket
            answer = predict(client, "int7", _X)
            want = OrtEngine(seven_bit).run({"x": _X})["y"]
            np.testing.assert_allclose(np.array(answer["outputs"]["y"], np.float32), want, rtol=1e-3, atol=1e-4)

            # 8-bit weights under a contract: verified within its budget against the saturated answers.
            contract = {"allow": ["int8"], "budget": {"cosine": 0.999}}
            assert upload(client, "int8-budget", eight_bit, {**CONFIG, "precision": contract}).status_code == 201
            bucket = settled_bucket(client, "int8-budget", "x=2x16x64")
            assert bucket["state"] == "ready" and set(bucket["latency_ms"]) == {"onnxruntime", "tvm"}, bucket
            assert metric_value(client.get("/metrics").text, "jitserve_compiles_total", model="int8-budget") == 1
    finally:
        server.stop()
