"""The ``approximate`` axis policy end to end: an axis whose padding changes the
outputs a little is padded within the stated tolerance, and each bucket reports
the error its kernel makes on its most padded request (real compile, real server)."""

from __future__ import annotations

import numpy as np

from compiler.running.engines import OrtEngine
from tests import synthetic
from tests.integration.serverproc import ServerProcess
from tests.integration.test_serving import upload, wait_ready

MODEL = synthetic.mean_mix_model()
REFERENCE = OrtEngine(MODEL)


def test_approximate_axis_pads_within_tolerance_and_reports_the_error(tmp_path):
    config = {"axes": {"W": {"kind": "pow2", "min": 8, "max": 64, "approximate": 0.05}}, "probe_sizes": {"W": 20}}
    server = ServerProcess(tmp_path / "data", routing="compiled", tuning_enabled=False).start()
    try:
        with server.client() as client:
            response = upload(client, "mix", MODEL, config)
            assert response.status_code == 201, response.text
            safety = client.get("/models/mix").json()["axes"]["W"]["padding_safety"]  # the probe's, after it
            assert safety["safe"] and safety["approximate"], safety
            assert safety["reason"].startswith("approximate: padding 20 -> 32 changes the outputs by up to")

            x = np.random.default_rng(3).standard_normal((1, 8, 20)).astype(np.float32)
            first = client.post("/predict", json={"model": "mix", "inputs": {"x": x.tolist()}}).json()
            assert first["engine"] == "onnxruntime" and first["bucket"] == "x=1x8x32"
            wait_ready(client, "mix", "x=1x8x32")
            served = client.post("/predict", json={"model": "mix", "inputs": {"x": x.tolist()}}).json()
            assert served["engine"] == "tvm"
            got, want = np.asarray(served["outputs"]["y"]), REFERENCE.run({"x": x})["y"]
            assert got.shape == want.shape == (1, 8, 20)
            error = float(np.abs(got - want).max())
            assert 1e-4 < error <= 0.05  # padded: not exact, within the tolerance

            bucket = client.get("/models/mix").json()["buckets"][0]
            assert 1e-4 < bucket["padded_error"]["tvm"] <= 0.05  # measured on its own input at W=17
    finally:
        server.stop()
