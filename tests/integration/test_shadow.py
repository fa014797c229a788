"""Shadow verification on real traffic: a kernel right on the compile's random inputs and wrong on
inputs real traffic brings (saturated pixels) serves until a sampled request shows it, then is demoted
for good: its bucket routes to ONNX Runtime with the reason, across a restart.

The wrong kernel is made on purpose: the stored model file is replaced with another graph before the
first compile, so the compile child builds and verifies that graph while the server's own ONNX Runtime
session keeps the uploaded one."""

from __future__ import annotations

import shutil

import numpy as np

from compiler.running.engines import OrtEngine
from tests import synthetic
from tests.integration.serverproc import ServerProcess, metric_value, wait_until
from tests.integration.test_serving import predict, settled_bucket, upload

RIGHT = synthetic.saturation_model()
WRONG = synthetic.saturation_model(wrong=True)


def bucket_of(client, model: str, label: str) -> dict:
    return next(b for b in client.get(f"/models/{model}").json()["buckets"] if b["bucket"] == label)


def test_a_kernel_wrong_on_real_inputs_is_demoted_by_a_shadow_check(tmp_path):
    reference = OrtEngine(RIGHT)
    rng = np.random.default_rng(5)
    server = ServerProcess(tmp_path / "data", routing="compiled", shadow_rate=0.5, shadow_max_per_second=1000).start()
    try:
        with server.client() as client:
            assert upload(client, "sat", RIGHT).status_code == 201
            stored = server.data_dir / "models" / "sat" / "v1" / "model.onnx"
            shutil.copy(stored, tmp_path / "right.onnx")
            stored.write_bytes(WRONG)  # what the compile child reads: the kernel is built from WRONG

            noise = rng.standard_normal((1, 16)).astype(np.float32)
            assert predict(client, "sat", noise)["engine"] == "onnxruntime"
            bucket = settled_bucket(client, "sat", "x=1x16")
            assert bucket["state"] == "ready" and bucket["engine"] == "tvm", bucket  # verified, gated, routed
            for _ in range(20):  # random-looking traffic: checked, and right
                x = rng.standard_normal((1, 16)).astype(np.float32)
                answer = predict(client, "sat", x)
                assert answer["engine"] == "tvm"
                np.testing.assert_allclose(answer["outputs"]["y"], reference.run({"x": x})["y"], rtol=1e-5)
            wait_until(lambda: metric_value(client.get("/metrics").text, "jitserve_shadow_checks_total") >= 5)

            # images: pixels 0-255, some saturated
            sent = 0
            while bucket_of(client, "sat", "x=1x16")["engine"] == "tvm" and sent < 200:
                pixels = rng.integers(0, 256, (1, 16)).astype(np.float32)
                pixels[0, :4] = 255.0
                predict(client, "sat", pixels)
                sent += 1
            demoted = wait_until(
                lambda: (b := bucket_of(client, "sat", "x=1x16"))["engine"] == "onnxruntime" and b, timeout=30
            )
            text = client.get("/metrics").text
            sampled = metric_value(text, "jitserve_shadow_checks_total", model="sat", outcome="mismatch")
            assert sampled == 1 and sent <= 100, (sampled, sent)
            assert demoted["reason"].startswith("shadow check: output 'y' differed by 55 on a served request; tvm")
            assert list(demoted["demoted"]) == [demoted["kernel"]]
            # Counted right after the bucket shows the demotion (the shadow thread demotes, then counts).
            wait_until(
                lambda: metric_value(client.get("/metrics").text, "jitserve_shadow_demotions_total", model="sat") == 1,
                timeout=5,
                interval=0.05,
                what="the demotion's count",
            )
            assert metric_value(text, "jitserve_shadow_checks_total", model="sat", outcome="match") >= 5
            answer = predict(client, "sat", pixels)
            assert answer["engine"] == "onnxruntime"
            np.testing.assert_allclose(answer["outputs"]["y"], reference.run({"x": pixels})["y"])
            log = server.log()
            assert "sha256" in log and "max 255.0" in log  # the input's summary; never its values
            assert str(pixels.tolist()) not in log

        shutil.copy(tmp_path / "right.onnx", stored)  # the upload's bytes again: its digest holds at start
        server.restart()
        with server.client() as client:
            assert predict(client, "sat", noise)["engine"] == "onnxruntime"
            again = settled_bucket(client, "sat", "x=1x16")
            assert again["engine"] == "onnxruntime" and again["reason"] == demoted["reason"]
            assert predict(client, "sat", noise)["engine"] == "onnxruntime"
    finally:
        server.stop()
