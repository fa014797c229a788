"""Serving on CUDA end to end (``JITSERVE_TARGET=cuda``): a real server uploads PP-OCR's classifier,
answers from ONNX Runtime at once (its CUDA provider where installed), compiles, verifies and times the
CUDA kernel, routes between the two engines, batches requests, and counts it all in its metrics.
Skipped where no CUDA device is present (CI has none)."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

from compiler.running.engines import OrtEngine
from tests.compiler.test_cuda_device import _cuda_present
from tests.integration.serverproc import ServerProcess
from tests.integration.test_serving import probed, settled_bucket
from tests.realmodels import CLS, rapidocr_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not _cuda_present(), reason="needs a CUDA device"),
]


def test_cuda_server_uploads_verifies_routes_and_batches(tmp_path):
    data = rapidocr_model(CLS).read_bytes()
    config = (
        '{"warm_buckets": [{"x": [1, 3, 48, 192]}, {"x": [4, 3, 48, 192]}],'
        ' "dynamic_batching": {"max_batch_size": 4, "max_queue_delay_us": 20000, "preferred_batch_sizes": [4]}}'
    )
    server = ServerProcess(tmp_path / "data", target="cuda").start()
    try:
        with server.client() as client:
            response = client.put("/models/cls", files={"model": ("cls.onnx", data), "config": (None, config)})
            assert response.status_code == 201, response.text
            probed(client, "cls")  # warm buckets and batching wait for the padding probe's verdicts
            image = np.random.default_rng(3).random((1, 3, 48, 192)).astype(np.float32)
            reference = OrtEngine(data)  # the CPU provider: fp32, whatever the server runs
            want = reference.run({"x": image})
            first = client.post("/predict", json={"model": "cls", "inputs": {"x": image.tolist()}})
            assert first.status_code == 200, first.text
            assert first.json()["engine"] == "onnxruntime"
            for label in ("x=1x3x48x192", "x=4x3x48x192"):
                bucket = settled_bucket(client, "cls", label, timeout=600)
                assert bucket["state"] == "ready", bucket
                assert set(bucket["latency_ms"]) == {"onnxruntime", "tvm"}, bucket

            def ask(seed: int) -> tuple[dict, np.ndarray]:
                rows = np.random.default_rng(seed).random((1, 3, 48, 192)).astype(np.float32)
                got = client.post("/predict", json={"model": "cls", "inputs": {"x": rows.tolist()}})
                assert got.status_code == 200, got.text
                return got.json(), rows

            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                answers = list(pool.map(ask, range(16)))
            for answer, rows in answers:
                for output, value in reference.run({"x": rows}).items():
                    np.testing.assert_allclose(answer["outputs"][output], value, rtol=1e-3, atol=1e-4)
            for output, value in want.items():  # cuDNN's fp32 against the CPU's: summation order only
                np.testing.assert_allclose(first.json()["outputs"][output], value, rtol=1e-4, atol=1e-5)
            metrics = client.get("/metrics").text
            compiled = [line for line in metrics.splitlines() if line.startswith("jitserve_compiles_total{")]
            assert any('target="cuda"' in line and 'outcome="ok"' in line for line in compiled), compiled
            batches = [line for line in metrics.splitlines() if line.startswith("jitserve_batch_size_count")]
            assert batches and float(batches[0].split()[-1]) > 0, batches
    finally:
        server.stop()
