"""Quantized models on a real server. With no contract, no TVM compile is spent on a dynamically
quantized model's buckets, and ONNX Runtime serves with its int8 kernels. Where its owner's contract
allows int8 within a budget, the compiled tier's integer kernels are compiled, verified within it and
timed beside ONNX Runtime: dynamically quantized weights on byte panels (8-bit and 7-bit), and a statically
quantized (QDQ) encoder's projections and convnet's convs in integers."""

from __future__ import annotations

import numpy as np
from onnxruntime.quantization import QuantFormat

from compiler.running.engines import OrtEngine
from compiler.running.precision import AccuracyBudget, compare_within_budget
from tests.compiler.test_quantized import dynamic_quantized_encoder, static_quantized_convnet, static_quantized_encoder
from tests.integration.serverproc import ServerProcess, metric_value
from tests.integration.test_serving import predict, settled_bucket, upload

CONFIG = {"axes": {"batch": {"kind": "pow2", "min": 1, "max": 4}}, "warm_buckets": [{"x": [2, 16, 64]}]}
BUDGET = {"cosine": 0.999}
_X = np.random.default_rng(3).standard_normal((2, 16, 64)).astype(np.float32)


def test_a_quantized_model_is_compiled_where_its_contract_allows_int8(tmp_path):
    eight_bit = dynamic_quantized_encoder(tmp_path)
    server = ServerProcess(tmp_path / "data", routing="compiled").start()
    try:
        with server.client() as client:
            assert upload(client, "int8", eight_bit, CONFIG).status_code == 201
            bucket = settled_bucket(client, "int8", "x=2x16x64")
            assert bucket["state"] == "failed"
            assert bucket["reason"].startswith("not compiled: a quantized graph (DynamicQuantizeLinear, MatMulInteger")
            assert "a precision contract that allows int8" in bucket["reason"]
            assert bucket["reason"].endswith("onnxruntime serves it with its int8 kernels")
            assert bucket["openvino"] is None  # a server without OpenVINO (tests/conftest.py)
            answer = predict(client, "int8", _X)
            assert answer["engine"] == "onnxruntime"
            want = OrtEngine(eight_bit).run({"x": _X})["y"]
            np.testing.assert_allclose(np.array(answer["outputs"]["y"], np.float32), want, rtol=1e-5, atol=1e-6)
            assert metric_value(client.get("/metrics").text, "jitserve_compiles_total", model="int8") == 0

            contract = {"allow": ["int8"], "budget": BUDGET}
            # The QDQ encoder's budget is looser: ONNX Runtime's fused integer kernels answer its own literal
            # QDQ graph (optimizations off, which the compiled tier matches to the bit) at cosine 0.9993-0.9997.
            encoders = {
                "int8-budget": (dynamic_quantized_encoder(tmp_path), BUDGET),
                "int7-budget": (dynamic_quantized_encoder(tmp_path, reduce_range=True), BUDGET),
                "qdq-encoder": (static_quantized_encoder(tmp_path), {"cosine": 0.98}),  # its projections in integers
            }
            for name, (data, budget) in encoders.items():
                config = {**CONFIG, "precision": {"allow": ["int8"], "budget": budget}}
                assert upload(client, name, data, config).status_code == 201
                bucket = settled_bucket(client, name, "x=2x16x64")
                assert bucket["state"] == "ready" and set(bucket["latency_ms"]) == {"onnxruntime", "tvm"}, bucket
                assert metric_value(client.get("/metrics").text, "jitserve_compiles_total", model=name) == 1
                answer = predict(client, name, _X)
                want = OrtEngine(data).run({"x": _X})
                got = {"y": np.array(answer["outputs"]["y"], np.float32)}
                assert compare_within_budget(got, want, AccuracyBudget(**budget)).matches, answer["engine"]

            convnet = {"axes": {"N": {"kind": "pow2", "min": 1, "max": 2}}, "warm_buckets": [{"x": [2, 3, 56, 56]}]}
            images = np.random.default_rng(4).standard_normal((2, 3, 56, 56)).astype(np.float32)
            for quant_format in (QuantFormat.QDQ, QuantFormat.QOperator):  # QOperator: compiled as its QDQ spelling
                name, data = quant_format.name.lower(), static_quantized_convnet(tmp_path, quant_format)
                assert upload(client, name, data, {**convnet, "precision": contract}).status_code == 201
                bucket = settled_bucket(client, name, "x=2x3x56x56")
                assert bucket["state"] == "ready" and set(bucket["latency_ms"]) == {"onnxruntime", "tvm"}, bucket
                answer = predict(client, name, images)
                got = {"y": np.array(answer["outputs"]["y"], np.float32)}
                want = OrtEngine(data).run({"x": images})
                assert compare_within_budget(got, want, AccuracyBudget(**BUDGET)).matches, name
    finally:
        server.stop()
