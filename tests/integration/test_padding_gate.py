"""The padding gate: a kernel whose answer to its bucket's most padded request differs from ONNX
Runtime's on the exact request is never routed, whatever the axis's verdict; the axis is found unsafe
for every bucket of the model, and stays so across a restart."""

from __future__ import annotations

import json

import numpy as np

from compiler.running.engines import OrtEngine
from compiler.shapes.padding import PROBE_VERSION
from tests import synthetic
from tests.integration.serverproc import ServerProcess, metric_value
from tests.integration.test_serving import predict, probed, settled_bucket, upload

# W <= 100 leaves x alone, past it the mean over W is added: a probe at the config's small size (20 -> 32,
# confirmed at 60 -> 64) finds padding harmless; a request of 65-100 padded to 128 is not.
MODEL = synthetic.long_axis_mix_model(threshold=100)


def test_a_kernel_wrong_on_padded_requests_is_never_routed_and_the_axis_is_revised(tmp_path):
    reference = OrtEngine(MODEL)
    rng = np.random.default_rng(11)
    short = rng.standard_normal((1, 8, 90)).astype(np.float32)
    server = ServerProcess(tmp_path / "data", routing="compiled").start()
    try:
        with server.client() as client:
            created = upload(client, "mix", MODEL, {"probe_sizes": {"W": 20}})
            assert created.status_code == 201, created.text
            axis = client.get("/models/mix").json()["axes"]["W"]
            assert axis["padding_safety"]["safe"] is True  # the probe was fooled
            first = predict(client, "mix", short)
            assert first["bucket"] == "x=1x8x128" and first["engine"] == "onnxruntime"

            bucket = settled_bucket(client, "mix", "x=1x8x128")
            # routing=compiled would take any verified kernel: the gate alone keeps it off
            assert bucket["state"] == "ready" and bucket["engine"] == "onnxruntime", bucket
            assert bucket["reason"].startswith("padding gate: tvm not routed, output 'y' differs by up to ")
            assert bucket["reason"].endswith("on request x=1x8x65")
            assert bucket["padded_error"]["tvm"] > 0.01

            axis = client.get("/models/mix").json()["axes"]["W"]
            assert axis["padding_safety"]["safe"] is False
            assert axis["padding_safety"]["reason"].startswith(
                "revised by the padding gate on bucket x=1x8x128: at 65 -> 128, padding changes the outputs"
            )
            assert axis["effective_policy"] == "dynamic"
            for x in (short, rng.standard_normal((1, 8, 70)).astype(np.float32)):
                answer = predict(client, "mix", x)
                assert answer["bucket"] != "x=1x8x128"  # never padded on W again
                np.testing.assert_allclose(answer["outputs"]["y"], reference.run({"x": x})["y"], rtol=1e-4, atol=1e-5)
            text = client.get("/metrics").text
            assert metric_value(text, "jitserve_padding_gate_refusals_total", model="mix") == 1
            assert metric_value(text, "jitserve_padding_verdicts_revised_total", model="mix") == 1

        server.restart()
        with server.client() as client:
            axis = client.get("/models/mix").json()["axes"]["W"]
            assert axis["padding_safety"]["reason"].startswith("revised by the padding gate")
            answer = predict(client, "mix", short)
            np.testing.assert_allclose(answer["outputs"]["y"], reference.run({"x": short})["y"], rtol=1e-4, atol=1e-5)
    finally:
        server.stop()


def test_verdicts_stored_by_an_older_probe_are_made_again_at_start(tmp_path):
    server = ServerProcess(tmp_path / "data", compile_workers=0).start()
    try:
        with server.client() as client:
            assert upload(client, "conv", synthetic.conv_pool_model()).status_code == 201
        server.stop()
        # what the probe at 3 -> 4 stored: every axis safe, and a route measured under that verdict
        path = server.data_dir / "models" / "conv" / "v1" / "record.json"
        record = json.loads(path.read_text())
        assert record["probe_version"] == PROBE_VERSION and not record["safety"]["W"]["safe"]
        del record["probe_version"]
        for axis in ("H", "W"):
            record["safety"][axis].update(safe=True, reason="outputs match after padding 3 -> 4", output_axes={})
        record["buckets"]["x=1x3x64x64"] = {"key": "0" * 64, "model_version": 1, "route": "tvm"}
        path.write_text(json.dumps(record))

        server.start()
        with server.client() as client:
            axes = probed(client, "conv")["axes"]  # probed again in the background; served exactly meanwhile
            assert not axes["W"]["padding_safety"]["safe"] and axes["W"]["effective_policy"] == "dynamic"
        again = json.loads(path.read_text())
        assert again["probe_version"] == PROBE_VERSION and not again["safety"]["H"]["safe"]
        assert again["buckets"]["x=1x3x64x64"]["route"] is None  # timed and gated again once compiled
    finally:
        server.stop()
