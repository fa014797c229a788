"""The dynamic-shape tier on a real server with a real compile: an axis whose
padding would change the outputs, declared ``dynamic``, is served within its
range by one symbolic kernel (verified against ONNX Runtime at the range's
ends, middle and vector tails, timed against it like every tier); sizes
outside the range get buckets of their own. Left to the default policy, such
an axis gets a symbolic kernel per 4x range of the sizes its traffic shows."""

from __future__ import annotations

import json

import numpy as np

from compiler.running.engines import OrtEngine
from compiler.storage.store import EXPLAIN_DIR, KernelStore
from tests import synthetic
from tests.integration.serverproc import ServerProcess, metric_value
from tests.integration.test_serving import settled_bucket, upload

MODEL = synthetic.mean_mix_model(weight=1.0)  # y = x + mean(x over W): padding W changes every output
REFERENCE = OrtEngine(MODEL)
CONFIG = {"axes": {"W": {"kind": "dynamic", "min": 8, "max": 256}}}


def predict(client, width: int) -> dict:
    x = np.random.default_rng(width).standard_normal((1, 8, width)).astype(np.float32)
    response = client.post("/predict", json={"model": "m", "inputs": {"x": x.tolist()}})
    assert response.status_code == 200, response.text
    body = response.json()
    np.testing.assert_allclose(body["outputs"]["y"], REFERENCE.run({"x": x})["y"], rtol=1e-4, atol=1e-5)
    return body


def test_one_symbolic_kernel_serves_every_width_of_its_range(tmp_path):
    server = ServerProcess(tmp_path / "data", tuning_enabled=False, routing="compiled").start()
    try:
        with server.client() as client:
            assert upload(client, "m", MODEL, CONFIG).status_code == 201
            described = client.get("/models/m").json()
            axis = described["axes"]["W"]
            assert axis["effective_policy"] == "dynamic", axis
            assert "one symbolic kernel serves 8..256" in axis["padding_safety"]["reason"], axis

            first = predict(client, 9)
            label = "x=1x8xW@8..256"
            assert (first["bucket"], first["engine"]) == (label, "onnxruntime")  # served while it compiles
            bucket = settled_bucket(client, "m", label)
            assert bucket["state"] == "ready", bucket
            assert bucket["shapes"] == {"x": [1, 8, "W@8..256"]}
            assert set(bucket["latency_ms"]) == {"onnxruntime", "tvm"}  # timed against ONNX Runtime
            for width in (8, 9, 77, 200, 255, 256):  # one bucket, one kernel, no padding
                body = predict(client, width)
                assert (body["bucket"], body["engine"]) == (label, "tvm"), width

            for width in (7, 257):  # just outside the range: buckets of their own, never the range's kernel
                assert predict(client, width)["bucket"] == f"x=1x8x{width}"
            labels = {b["bucket"] for b in client.get("/models/m").json()["buckets"]}
            assert labels == {label, "x=1x8x7", "x=1x8x257"}
            store = KernelStore(tmp_path / "data" / "kernels")
            keys = list(store.keys())  # the store's entries (it is no mapping)
            bundles = [store.path(key) / EXPLAIN_DIR / "explain.json" for key in keys]
            assert bundles and all(path.is_file() for path in bundles)  # every compile explained by default
            explained = [json.loads(path.read_text())["bucket"] for path in bundles]
            assert {"x": [1, 8, "W@8..256"]} in explained
            text = client.get("/metrics").text
            assert metric_value(text, "jitserve_compiles_total", model="m", tier="tvm-dynamic", outcome="ok") == 1
            assert metric_value(text, "jitserve_dynamic_requests_total", model="m", engine="onnxruntime") == 1
            assert metric_value(text, "jitserve_dynamic_requests_total", model="m", engine="tvm") == 6
    finally:
        server.stop()


def test_by_default_an_axis_padding_would_change_gets_a_kernel_per_range_of_its_traffic(tmp_path):
    """No config: W fails the padding check, so widths share symbolic kernels by 4x ranges (5..16, 17..64,
    65..256, 257..1024) instead of a compile per width."""
    server = ServerProcess(tmp_path / "data", tuning_enabled=False, routing="compiled").start()
    try:
        with server.client() as client:
            assert upload(client, "m", MODEL).status_code == 201
            axis = client.get("/models/m").json()["axes"]["W"]
            assert (axis["effective_policy"], axis["padding_safety"]["safe"]) == ("dynamic", False), axis
            ranges = {"5..16": [9, 16, 11], "17..64": [40, 64], "65..256": [65, 100, 255, 201], "257..1024": [300]}
            expected = {width: f"x=1x8xW@{span}" for span, widths in ranges.items() for width in widths}
            for width in (9, 16, 40, 64, 65, 100, 255, 300):  # the storm: four compiles, one per range
                assert predict(client, width)["bucket"] == expected[width]
            for label in set(expected.values()):
                assert settled_bucket(client, "m", label)["state"] == "ready"
            for width, label in expected.items():  # 11 and 201 too: sizes no request had before
                body = predict(client, width)
                assert (body["bucket"], body["engine"]) == (label, "tvm"), width
            labels = {b["bucket"] for b in client.get("/models/m").json()["buckets"]}
            assert labels == set(expected.values())
    finally:
        server.stop()


def test_a_stepped_dynamic_axis_serves_a_detector_neck_at_every_multiple(tmp_path):
    """A detector takes multiples of its stride only: declared with a step, one symbolic kernel serves
    every multiple of the range; a size that is no multiple gets a bucket of its own, and where ONNX
    Runtime refuses it (the neck's shapes disagree) the client gets a 400 naming the problem."""
    model = synthetic.fpn_model()
    reference = OrtEngine(model)
    policy = {"kind": "dynamic", "min": 32, "max": 96, "step": 4}
    server = ServerProcess(tmp_path / "data", tuning_enabled=False, routing="compiled", explain_bundles=False).start()
    try:
        with server.client() as client:
            assert upload(client, "neck", model, {"axes": {"h": policy, "w": policy}}).status_code == 201
            axis = client.get("/models/neck").json()["axes"]["h"]
            assert "serves 32..96 in steps of 4" in axis["padding_safety"]["reason"], axis

            def infer(height: int, width: int):
                x = np.random.default_rng(height * width).standard_normal((1, 4, height, width)).astype(np.float32)
                response = client.post("/predict", json={"model": "neck", "inputs": {"x": x.tolist()}})
                if response.status_code == 200:
                    got = np.array(response.json()["outputs"]["y"], np.float32)
                    np.testing.assert_allclose(got, reference.run({"x": x})["y"], rtol=1e-4, atol=1e-4)
                return response

            label = "x=1x4xh@32..96:4xw@32..96:4"
            assert infer(40, 52).json()["bucket"] == label
            assert settled_bucket(client, "neck", label)["state"] == "ready"
            for height, width in ((32, 96), (36, 44), (92, 60)):  # even and odd counts of the step
                body = infer(height, width).json()
                assert (body["bucket"], body["engine"]) == (label, "tvm"), (height, width)
            refused = infer(38, 44)  # 38 / 2 = 19, / 2 = 10, x 2 = 20: the Add cannot take it
            assert refused.status_code == 400, refused.text
            assert "cannot run the model on this input's shape (Add node" in refused.json()["error"]
            store = KernelStore(tmp_path / "data" / "kernels")
            keys = list(store.keys())  # the store's entries (it is no mapping)
            entries = [store.path(key) for key in keys]
            assert entries and not any((entry / EXPLAIN_DIR).exists() for entry in entries)  # turned off
    finally:
        server.stop()
