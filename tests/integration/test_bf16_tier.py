"""TVM's bf16 tier on a real server: a model whose precision contract allows bf16 gets a second kernel per
CPU bucket with its convs and matmuls by weights in bf16, verified within the contract's budget and routed
like any engine; a restart restores its route without a compile, a budget it cannot keep keeps it off, and
a CPU without AVX512-BF16 or AMX compiles none unless told to (``tvm_bf16``)."""

from __future__ import annotations

import numpy as np

from compiler.building.matrix_units import host_matrix_units
from compiler.running.engines import OrtEngine
from tests import convnets
from tests.integration.serverproc import ServerProcess, delete_and_wait_released, metric_value
from tests.integration.test_serving import predict, settled_bucket, upload

IMAGES = {"axes": {"N": {"kind": "pow2", "min": 1, "max": 2}}, "warm_buckets": [{"x": [1, 3, 56, 56]}]}
LABEL = "x=1x3x56x56"
LOOSE = {"allow": ["bf16"], "budget": {"cosine": 0.999, "atol": 0.05, "rtol": 0.05}}


def _image(seed: int = 5) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, 3, 56, 56)).astype(np.float32)


def test_a_bf16_contract_compiles_routes_and_restores_a_bf16_kernel(tmp_path):
    data = convnets.residual_model()
    want = OrtEngine(data).run({"x": _image()})["y"]
    # ``always``: this CPU may have no bf16 unit; the kernel's products are then summed on its FMA units.
    # ``compiled`` routing serves the bf16 kernel whatever it measures, so its answers are the ones checked.
    server = ServerProcess(
        tmp_path / "data", openvino=False, tuning_enabled=False, tvm_bf16="always", routing="compiled"
    ).start()
    try:
        with server.client() as client:
            assert upload(client, "res", data, {**IMAGES, "precision": LOOSE}).status_code == 201
            bucket = settled_bucket(client, "res", LABEL)
            assert bucket["state"] == "ready", bucket
            bf16 = bucket["tvm_bf16"]
            assert bf16["failure"] is None and bf16["kernels_in_bf16"] >= 1, bf16
            assert bf16["key"] != bucket["kernel"]  # a kernel of its own
            assert bf16["verification"].startswith("within budget (") and "cosine" in bf16["verification"]
            assert set(bucket["latency_ms"]) == {"onnxruntime", "tvm", "tvm-bf16"}
            assert bucket["engine"] == "tvm-bf16" and "tvm-bf16" in bucket["padded_error"]
            answer = predict(client, "res", _image())
            assert answer["engine"] == "tvm-bf16"
            got = np.array(answer["outputs"]["y"], np.float32)
            np.testing.assert_allclose(got, want, rtol=0.05, atol=0.05)
            assert np.abs(got - want).max() > 1e-4  # bf16 operands: not fp32's answer
            text = client.get("/metrics").text
            assert metric_value(text, "jitserve_compiles_total", model="res", tier="tvm-bf16", outcome="ok") == 1
            assert metric_value(text, "jitserve_compiles_total", model="res", tier="tvm", outcome="ok") == 1

        server.restart()
        with server.client() as client:
            bucket = settled_bucket(client, "res", LABEL)
            assert bucket["engine"] == "tvm-bf16" and bucket["tvm_bf16"]["key"] == bf16["key"], bucket
            again = predict(client, "res", _image())
            assert again["engine"] == "tvm-bf16" and again["outputs"] == answer["outputs"]
            assert metric_value(client.get("/metrics").text, "jitserve_compiles_total", model="res") == 0
            delete_and_wait_released(client, "res")
    finally:
        server.stop()


def test_a_bf16_kernel_out_of_budget_or_without_a_unit_never_serves(tmp_path):
    data = convnets.residual_model()
    tight = {"allow": ["bf16"], "budget": {"atol": 1e-6}}
    server = ServerProcess(tmp_path / "data", openvino=False, tuning_enabled=False, tvm_bf16="always").start()
    try:
        with server.client() as client:
            assert upload(client, "tight", data, {**IMAGES, "precision": tight}).status_code == 201
            bucket = settled_bucket(client, "tight", LABEL)
            assert bucket["state"] == "ready" and set(bucket["latency_ms"]) == {"onnxruntime", "tvm"}, bucket
            failure = bucket["tvm_bf16"]["failure"]
            assert failure.startswith("verification against onnxruntime:") and "beyond atol 1e-06" in failure
            text = client.get("/metrics").text
            assert metric_value(text, "jitserve_compiles_total", model="tight", tier="tvm-bf16",
                                outcome="verify_failed") == 1  # fmt: skip
    finally:
        server.stop()
    server = ServerProcess(tmp_path / "unit", openvino=False, tuning_enabled=False).start()  # tvm_bf16: unit
    try:
        with server.client() as client:
            assert upload(client, "res", data, {**IMAGES, "precision": LOOSE}).status_code == 201
            bucket = settled_bucket(client, "res", LABEL)
            missing = host_matrix_units().missing("bf16")
            if missing:
                assert bucket["tvm_bf16"]["failure"] == f"not compiled: {missing}", bucket
                assert set(bucket["latency_ms"]) == {"onnxruntime", "tvm"}
            else:  # AVX512-BF16 or AMX: compiled and measured
                assert "tvm-bf16" in bucket["latency_ms"] and bucket["tvm_bf16"]["failure"] is None, bucket
    finally:
        server.stop()
