"""OpenVINO as a third engine on a real server: built for a bucket as it is routed, verified against ONNX
Runtime (within one quantization step on an int8 model's dequantized outputs), timed beside ONNX Runtime
and TVM, and serving where it measured fastest; a model it cannot read, or that it answers differently,
is served as without it."""

from __future__ import annotations

import numpy as np
import pytest
from onnxruntime.quantization import QuantFormat

from compiler.building.matrix_units import host_matrix_units
from compiler.models.model import load_model
from compiler.running.engines import OrtEngine
from compiler.running.openvino_engine import openvino_capabilities
from tests import convnets
from tests.compiler.test_quantized import dynamic_quantized_encoder, static_quantized_convnet
from tests.integration.serverproc import ServerProcess, delete_and_wait_released, metric_value
from tests.integration.test_serving import predict, settled_bucket, upload

pytest.importorskip("openvino")

IMAGES = {"axes": {"N": {"kind": "pow2", "min": 1, "max": 2}}, "warm_buckets": [{"x": [1, 3, 56, 56]}]}
LABEL = "x=1x3x56x56"


def _image(seed: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, 3, 56, 56)).astype(np.float32)


def test_three_engines_are_timed_and_the_fastest_verified_one_serves(tmp_path):
    data = convnets.residual_model()
    server = ServerProcess(tmp_path / "data", openvino=True, tuning_enabled=False).start()
    try:
        with server.client() as client:
            assert upload(client, "res", data, IMAGES).status_code == 201
            bucket = settled_bucket(client, "res", LABEL)
            assert bucket["state"] == "ready", bucket
            latency = bucket["latency_ms"]
            assert set(latency) == {"onnxruntime", "tvm", "openvino"} and all(v > 0 for v in latency.values())
            fastest = min(latency, key=latency.get)
            assert bucket["engine"] == fastest
            assert set(bucket["openvino"]) == {"openvino"}  # no precision contract: fp32 alone
            openvino = bucket["openvino"]["openvino"]
            assert openvino["key"].startswith("openvino-") and openvino["bytes"] >= 0
            assert openvino["verification"] == "ok" and openvino["build_seconds"] > 0
            assert openvino["precision"] == "f32"
            answer = predict(client, "res", _image())
            assert answer["engine"] == fastest
            want = OrtEngine(data).run({"x": _image()})["y"]
            np.testing.assert_allclose(np.array(answer["outputs"]["y"], np.float32), want, rtol=1e-3, atol=1e-4)
            text = client.get("/metrics").text
            # OpenVINO's compile of the version is its own, never counted as a TVM compile.
            assert metric_value(text, "jitserve_openvino_compiles_total", model="res", outcome="ok") == 1
            assert metric_value(text, "jitserve_openvino_bucket_builds_total", model="res", engine="openvino") == 1
            assert metric_value(text, "jitserve_compiles_total", model="res", tier="openvino") == 0
            assert metric_value(text, "jitserve_compiles_total", model="res", tier="tvm", outcome="ok") == 1
            assert metric_value(text, "jitserve_routing_decisions_total", model="res", engine=fastest) == 1
            # Whatever serves, the bucket holds one engine in the cache besides TVM's kernel: OpenVINO's
            # build was let go if it lost. A delete leaves nothing.
            held = metric_value(text, "jitserve_kernel_cache_entries")
            assert held == (2 if fastest == "openvino" else 1)
            delete_and_wait_released(client, "res")
    finally:
        server.stop()


def test_int8_models_meet_openvino_with_no_tvm_compile(tmp_path):
    """A static QDQ model: OpenVINO verifies (within one quantization step at most) and serves (routing
    ``compiled`` prefers a verified engine to ONNX Runtime). A dynamically quantized encoder: where
    OpenVINO's int8 answers differ beyond fp32's tolerance (no output of it is dequantized), ONNX Runtime
    serves, unless a contract allows int8 within a budget (the compiled tier's integer kernels then compete
    too). A QOperator model with ONNX Runtime's own ops:
    OpenVINO cannot read it, and ONNX Runtime serves as without it."""
    qdq = static_quantized_convnet(tmp_path, QuantFormat.QDQ)
    step = load_model(qdq, max_bytes=1 << 26).output_steps["y"]
    server = ServerProcess(tmp_path / "data", openvino=True, routing="compiled", tuning_enabled=False).start()
    try:
        with server.client() as client:
            assert upload(client, "qdq", qdq, IMAGES).status_code == 201
            bucket = settled_bucket(client, "qdq", LABEL)
            assert bucket["state"] == "ready" and bucket["engine"] == "openvino", bucket
            assert set(bucket["latency_ms"]) == {"onnxruntime", "openvino"}
            assert bucket["reason"].startswith("not compiled: a quantized graph (")
            # Within one step; or within fp32's tolerance, where both engines run the same int8 arithmetic
            # (seen on an Intel Xeon with AVX512-VNNI).
            verification = bucket["openvino"]["openvino"]["verification"]
            assert verification == "ok" or "within one quantization step" in verification, verification
            answer = predict(client, "qdq", _image())
            assert answer["engine"] == "openvino"
            got = np.array(answer["outputs"]["y"], np.float32)
            want = OrtEngine(qdq).run({"x": _image()})["y"]
            assert np.mean(np.abs(got - want) <= step * 1.001) >= 0.999

            encoder = {"axes": {"batch": {"kind": "pow2", "min": 1, "max": 4}}, "warm_buckets": [{"x": [2, 16, 64]}]}
            dynamic = dynamic_quantized_encoder(tmp_path)
            assert upload(client, "dyn", dynamic, encoder).status_code == 201
            bucket = settled_bucket(client, "dyn", "x=2x16x64")
            if bucket["state"] == "failed":  # OpenVINO's int8 arithmetic is not ONNX Runtime's (AMD EPYC, AVX2)
                assert "onnxruntime serves it with its int8 kernels; openvino: verification against" in bucket["reason"]
            else:  # the same int8 arithmetic, within fp32's tolerance (Intel Xeon, AVX512-VNNI)
                assert bucket["engine"] == "openvino" and bucket["openvino"]["openvino"]["verification"] == "ok", bucket
            # Its owner's contract allows another engine's int8 within a budget: OpenVINO then competes, beside
            # the compiled tier's integer kernels (tests/integration/test_quantized.py).
            contract = {"allow": ["int8"], "budget": {"cosine": 0.99}}
            assert upload(client, "dyn-budget", dynamic, {**encoder, "precision": contract}).status_code == 201
            bucket = settled_bucket(client, "dyn-budget", "x=2x16x64")
            assert bucket["state"] == "ready" and bucket["engine"] in ("openvino", "tvm"), bucket
            assert set(bucket["latency_ms"]) == {"onnxruntime", "openvino", "tvm"}, bucket
            assert bucket["openvino"]["openvino"]["verification"].startswith("within budget (")

            qop = static_quantized_convnet(tmp_path, QuantFormat.QOperator)
            assert upload(client, "qop", qop, IMAGES).status_code == 201
            bucket = settled_bucket(client, "qop", LABEL)
            assert bucket["state"] == "failed", bucket
            assert "openvino: openvino cannot compile the model" in bucket["reason"]
            assert "com.microsoft.QGemm" in bucket["reason"]
            assert predict(client, "qop", _image())["engine"] == "onnxruntime"

            text = client.get("/metrics").text
            for model in ("qdq", "dyn", "qop"):
                assert metric_value(text, "jitserve_compiles_total", model=model, tier="tvm") == 0
    finally:
        server.stop()


def test_a_precision_contract_lets_a_reduced_precision_compete_within_its_budget(tmp_path):
    """Two uploads of one convnet: one allows fp16-stored weights (and bf16) within a loose budget, the
    other within a budget too tight for them. The first measures the reduced-precision engine beside the
    rest; the second refuses it with the error it measured; bf16 where the CPU lacks it says so."""
    data = convnets.residual_model()
    loose = {"allow": ["f16-weights", "bf16"], "budget": {"cosine": 0.999, "atol": 0.05, "rtol": 0.05}}
    tight = {"allow": ["f16-weights"], "budget": {"atol": 1e-7}}
    server = ServerProcess(tmp_path / "data", openvino=True, tuning_enabled=False).start()
    try:
        with server.client() as client:
            refused = upload(client, "bad", data, {**IMAGES, "precision": {"allow": ["int4"], "budget": {}}})
            assert refused.status_code == 400 and "precision" in refused.json()["error"], refused.text

            assert upload(client, "loose", data, {**IMAGES, "precision": loose}).status_code == 201
            bucket = settled_bucket(client, "loose", LABEL)
            assert bucket["state"] == "ready", bucket
            # bf16 arithmetic competes too where the CPU has it (AMX or AVX512-BF16), and verifies within the budget.
            bf16_here = "BF16" in openvino_capabilities()
            tvm_bf16_here = host_matrix_units().unit("bf16") is not None  # TVM's bf16 tier (tvm_bf16: unit)
            measured = (
                {"onnxruntime", "tvm", "openvino", "openvino-f16-weights"}
                | ({"openvino-bf16"} if bf16_here else set())
                | ({"tvm-bf16"} if tvm_bf16_here else set())
            )
            assert set(bucket["latency_ms"]) == measured
            assert bucket["engine"] == min(bucket["latency_ms"], key=bucket["latency_ms"].get)
            reduced = bucket["openvino"]["openvino-f16-weights"]
            assert reduced["precision"] == "f16-weights" and reduced["key"] != bucket["openvino"]["openvino"]["key"]
            assert reduced["verification"].startswith("within budget (") and "cosine" in reduced["verification"]
            assert "padding gate" not in (bucket["reason"] or "")  # the gate judged it by the budget too
            bf16 = bucket["openvino"]["openvino-bf16"]
            if bf16_here:
                assert bf16["precision"] == "bf16" and bf16["verification"].startswith("within budget ("), bf16
            else:
                assert "bf16 needs a CPU with it" in bf16["failure"], bf16
            answer = predict(client, "loose", _image())
            assert answer["engine"] == bucket["engine"]
            want = OrtEngine(data).run({"x": _image()})["y"]
            np.testing.assert_allclose(np.array(answer["outputs"]["y"], np.float32), want, rtol=0.05, atol=0.05)

            assert upload(client, "tight", data, {**IMAGES, "precision": tight}).status_code == 201
            bucket = settled_bucket(client, "tight", LABEL)
            assert set(bucket["latency_ms"]) == {"onnxruntime", "tvm", "openvino"}
            failure = bucket["openvino"]["openvino-f16-weights"]["failure"]
            assert "within the precision contract's budget" in failure and "beyond atol 1e-07" in failure
            text = client.get("/metrics").text
            assert metric_value(text, "jitserve_openvino_bucket_builds_total", model="tight",
                                engine="openvino-f16-weights", outcome="verify_failed") == 1  # fmt: skip
    finally:
        server.stop()
