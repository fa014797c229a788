"""PP-OCR uploaded as a new user would, with no config: the padding probe finds the axes padding would
change (cls and rec widths, det's height and width) and serves them unpadded, and every answer, from
ONNX Runtime or a routed kernel, matches ONNX Runtime on the exact input."""

from __future__ import annotations

import numpy as np
import pytest

from compiler.running.engines import OrtEngine
from tests.integration.serverproc import ServerProcess, wait_until
from tests.integration.test_serving import predict, upload
from tests.realmodels import CLS, DET, REC, rapidocr_model

BATCH, HEIGHT, WIDTH = "x:0", "x:2", "x:3"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """ONNX Runtime alone: the verdicts and the tier-0 answers, with no compile to wait for."""
    server = ServerProcess(tmp_path_factory.mktemp("ocr") / "data", compile_workers=0).start()
    yield server
    server.stop()


def axes_of(client, name: str) -> dict[str, dict]:
    return {axis: facts["padding_safety"] for axis, facts in client.get(f"/models/{name}").json()["axes"].items()}


def settled(client, name: str) -> list[dict]:
    buckets = client.get(f"/models/{name}").json()["buckets"]
    return buckets if all(b["state"] in ("ready", "failed") for b in buckets) else []


def answers_match(client, name: str, data: bytes, shapes: list[tuple[int, ...]], tolerance: float) -> set[str]:
    """Every shape answered twice (before and after its bucket compiled), each answer against ONNX Runtime
    on the exact input; returns the engines that answered."""
    reference = OrtEngine(data)
    rng = np.random.default_rng(3)
    inputs = [rng.random(shape, dtype=np.float32) for shape in shapes]
    engines = set()
    for x in inputs:
        engines.add(predict(client, name, x)["engine"])
    wait_until(lambda: settled(client, name), timeout=600, what=f"{name}'s buckets to settle")
    for x in inputs:
        answer = predict(client, name, x)
        engines.add(answer["engine"])
        for output, want in reference.run({"x": x}).items():
            np.testing.assert_allclose(answer["outputs"][output], want, rtol=tolerance, atol=tolerance)
    return engines


@pytest.mark.slow
def test_cls_with_no_config_pads_only_its_batch_and_answers_right(tmp_path):
    data = rapidocr_model(CLS).read_bytes()
    # routing=compiled: every verified kernel the padding gate lets through serves, whatever it measures
    server = ServerProcess(tmp_path / "data", routing="compiled").start()
    try:
        with server.client() as client:
            assert upload(client, "cls", data).status_code == 201
            axes = axes_of(client, "cls")
            assert axes[BATCH]["safe"] and axes[BATCH]["reason"] == "outputs match after padding 3 -> 4"
            for axis in (HEIGHT, WIDTH):  # global pooling sees the padding at real sizes
                assert not axes[axis]["safe"] and axes[axis]["reason"].startswith("padding changes the outputs")
            # batch 3 (padded to 4), sizes of one dynamic range: one kernel. At heights 17..32 the last map
            # is one row high and its 2x2 MaxPool's window taller than it: the kernel answered NaN there.
            shapes = [(3, 3, h, w) for h, w in ((48, 100), (17, 192), (32, 65), (33, 240))]
            assert "tvm" in answers_match(client, "cls", data, shapes, 1e-4)
            buckets = client.get("/models/cls").json()["buckets"]
            assert [b["bucket"] for b in buckets] == ["x=4x3xx:2@17..64xx:3@65..256"]
            for bucket in buckets:  # the dynamic kernel verified (heights 17..32 too), timed and routed
                assert (bucket["state"], bucket["engine"]) == ("ready", "tvm"), bucket
                assert {"onnxruntime", "tvm"} <= set(bucket["latency_ms"]), bucket
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("short", ["rec", "det"])
def test_rec_and_det_with_no_config_find_their_spatial_axes_unsafe(server, short):
    name = {"rec": REC, "det": DET}[short]
    data = rapidocr_model(name).read_bytes()
    with server.client() as client:
        assert upload(client, short, data).status_code == 201
        batch, *spatial = axes_of(client, short).values()  # x's dims 0, 2 and 3, in order
        assert batch["safe"] is True and batch["reason"] == "outputs match after padding 3 -> 4"
        assert len(spatial) == 2 and not any(verdict["safe"] for verdict in spatial), spatial
        assert all(verdict["reason"].startswith(("padding changes", "output ")) for verdict in spatial), spatial
        reference = OrtEngine(data)
        rng = np.random.default_rng(4)
        for n, h, w in ((1, 48, 160), (3, 48, 320), (1, 64, 96)) if name == REC else ((1, 96, 160), (3, 128, 96)):
            x = rng.random((n, 3, h, w), dtype=np.float32)
            answer = predict(client, short, x)
            for output, want in reference.run({"x": x}).items():
                np.testing.assert_allclose(answer["outputs"][output], want, rtol=1e-4, atol=1e-4)
