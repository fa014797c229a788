"""Weights held once per model version, against a real server: a retrained model (same architecture,
new weights) reuses every kernel with 0 compiles, and a deleted model gives its memory back."""

from __future__ import annotations

import time

import numpy as np
import pytest

from compiler.models.weights import weight_bytes
from compiler.running.engines import OrtEngine
from compiler.storage.store import KernelStore
from tests import synthetic
from tests.integration.serverproc import ServerProcess, metric_value, new_graph_variant, wait_until
from tests.integration.test_serving import predict, upload, wait_ready

ENCODER = {"layers": 1, "hidden": 64, "heads": 4, "seq": 16}
CONFIG = {"axes": {"batch": {"kind": "pow2", "min": 1, "max": 8}}, "warm_buckets": [{"x": [2, 16, 64]}]}
LABEL = "x=2x16x64"


@pytest.fixture
def server(tmp_path):
    process = ServerProcess(tmp_path / "data", routing="compiled").start()
    yield process
    process.stop()


def _metric(client, name: str, **labels) -> float:
    return metric_value(client.get("/metrics").text, name, **labels)


def _engine(client, model: str, label: str) -> str | None:
    buckets = client.get(f"/models/{model}").json()["buckets"]
    return next((b["engine"] for b in buckets if b["bucket"] == label and b["state"] == "ready"), None)


def test_new_weights_are_served_by_the_same_kernels_without_a_compile(server):
    data = synthetic.bert_encoder_model(**ENCODER)
    retrained = synthetic.reweighted(data, 3)
    x = np.random.default_rng(1).standard_normal((2, 16, 64)).astype(np.float32)
    with server.client() as http:
        assert upload(http, "enc", data, CONFIG).status_code == 201
        wait_ready(http, "enc", LABEL)
        assert _engine(http, "enc", LABEL) == "tvm"
        compiles = _metric(http, "jitserve_compiles_total", model="enc")
        assert compiles == 1

        response = upload(http, "enc", retrained, CONFIG, replace="true")
        assert response.status_code == 201, response.text
        answered = time.monotonic()
        wait_until(lambda: _engine(http, "enc", LABEL) == "tvm", timeout=30, interval=0.05, what="the kernel")
        print(f"served by its kernel {time.monotonic() - answered:.2f} s after the replace answered")

        body = predict(http, "enc", x)
        assert body["version"] == 2 and body["engine"] == "tvm"
        want = OrtEngine(retrained).run({"x": x})["y"]
        np.testing.assert_allclose(np.array(body["outputs"]["y"], np.float32), want, rtol=1e-3, atol=1e-4)
        old = OrtEngine(data).run({"x": x})["y"]
        assert not np.allclose(want, old, atol=1e-3)  # the new weights are the ones running
        assert _metric(http, "jitserve_compiles_total", model="enc") == compiles  # 0 compiles
        assert _metric(http, "jitserve_kernel_reloads_total", model="enc") >= 1
        assert http.get("/readyz").status_code == 200


def _rss(client) -> float:
    return _metric(client, "jitserve_resident_memory_bytes")


def test_delete_gives_the_model_memory_back(tmp_path):
    """Upload, serve from two compiled buckets, delete; then again with the same bytes (the kernels reload
    from the store). Each delete ends near where the server started, and a round leaves nothing behind.
    With glibc's moving mmap threshold CI's machine kept 52 MiB of these 108 MiB after the delete."""
    big = synthetic.bert_encoder_model(layers=4, hidden=768, heads=12, seq=16)
    weights = weight_bytes(__import__("onnx").load_from_string(big))
    buckets = {"x=1x16x768": [1, 16, 768], "x=2x16x768": [2, 16, 768]}
    config = {
        "axes": {"batch": {"kind": "pow2", "min": 1, "max": 8}},
        "warm_buckets": [{"x": b} for b in buckets.values()],
    }
    x = np.random.default_rng(2).standard_normal((1, 16, 768)).astype(np.float32)
    # Background tuning would load kernels of its own meanwhile: this test weighs the model alone.
    process = ServerProcess(tmp_path / "data", routing="compiled", tuning_enabled=False).start()
    try:
        with process.client() as http:
            # TVM's and ONNX Runtime's own libraries load with the first model: measure after them.
            assert upload(http, "warmup", synthetic.bert_encoder_model(**ENCODER), CONFIG).status_code == 201
            wait_ready(http, "warmup", LABEL)
            predict(http, "warmup", np.zeros((2, 16, 64), np.float32))
            mapped_before = _metric(http, "jitserve_weights_bytes")  # the warm-up model's
            start = _rss(http)
            afters = []
            for _ in range(2):
                before = _rss(http)
                assert upload(http, "big", big, config).status_code == 201
                uploaded = _rss(http)
                for label, shape in buckets.items():
                    wait_ready(http, "big", label)
                    assert predict(http, "big", np.resize(x, shape))["engine"] == "tvm"
                loaded = _rss(http)
                # Two buckets, one copy of the weights: mapped once per version and shared by both kernels.
                assert 0.9 * weights < _metric(http, "jitserve_weights_bytes") - mapped_before < 1.1 * weights
                assert http.delete("/models/big").status_code == 204
                time.sleep(3)  # past the first delayed hand-back
                after = _rss(http)
                afters.append(after)
                mib = [round(value / 2**20) for value in (weights, before, uploaded, loaded, after)]
                print("MiB: weights {}; RSS before {}, uploaded {}, two buckets run {}, after delete {}".format(*mib))
                assert loaded - before > weights  # the model was really held
                assert uploaded - before < 2 * weights  # ONNX Runtime's session; nothing keeps the upload's bytes
                assert loaded - uploaded < 1.5 * weights  # one mapped copy for both kernels, not one each
                assert after - start < 0.2 * weights  # the delete gave back what the model held
                assert _metric(http, "jitserve_weights_bytes") == mapped_before
            assert _metric(http, "jitserve_compiles_total", model="big") == len(buckets)  # round two reloaded
            assert afters[1] - afters[0] < 0.1 * weights  # a round leaves nothing behind
    finally:
        process.stop()


def test_the_store_budget_removes_a_deleted_models_kernels_and_weights_not_the_served_ones(tmp_path):
    """A budget of one byte: whatever may go goes. The deleted model's kernel and weights go once unused
    for the grace period; the served model's kernel (in memory) and weights (a stored version's) stay."""
    data = synthetic.bert_encoder_model(**ENCODER)
    other = new_graph_variant(data, "another graph")
    settings = {"kernel_store_bytes": 1, "kernel_store_grace_seconds": 2, "kernel_store_sweep_seconds": 0.5}
    process = ServerProcess(tmp_path / "data", routing="compiled", **settings).start()
    store = KernelStore(tmp_path / "data" / "kernels")
    try:
        with process.client() as http:
            for name, model in (("gone", data), ("kept", other)):
                assert upload(http, name, model, CONFIG).status_code == 201
                wait_ready(http, name, LABEL)
            described = {name: http.get(f"/models/{name}").json() for name in ("gone", "kept")}
            digests = {name: d["digest"] for name, d in described.items()}
            keys = {
                name: next(b["kernel"] for b in d["buckets"] if b["bucket"] == LABEL) for name, d in described.items()
            }
            assert keys["gone"] != keys["kept"] and all(store.get(key) for key in keys.values())

            assert http.delete("/models/gone").status_code == 204

            def removed() -> bool:
                return _metric(http, "jitserve_kernel_store_removals_total", reason="unreferenced") >= 2

            wait_until(removed, timeout=30, interval=0.25, what="the budget's sweep")
            assert store.get(keys["gone"]) is None and not store.has_prepared(digests["gone"])
            assert store.get(keys["kept"]) is not None and store.has_prepared(digests["kept"])
            assert _metric(http, "jitserve_kernel_store_removed_bytes_total", kind="weights") >= weight_bytes(
                __import__("onnx").load_from_string(data)
            )
            assert _metric(http, "jitserve_kernel_store_bytes") > 0  # what stays: in use or needed
            x = np.ones((2, 16, 64), np.float32)
            assert predict(http, "kept", x)["engine"] == "tvm"
        assert "kernel store: removed kernel" in process.log_path.read_text()
    finally:
        process.stop()
