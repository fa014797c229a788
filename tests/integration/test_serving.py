"""The serving path end to end, against a real server process: JIT compiles,
bucket padding, metrics, restart, replace, eviction."""

from __future__ import annotations

import json
import shutil
import threading

import numpy as np
import pytest

from compiler.running.engines import OrtEngine
from tests import synthetic
from tests.integration.serverproc import ServerProcess, metric_value, variant, wait_until
from tests.realmodels import CLS, rapidocr_model

CLS_CONFIG = {
    "axes": {"x:0": {"kind": "pow2", "min": 1, "max": 8}},
    "probe_sizes": {"x:0": 3, "x:2": 48, "x:3": 192},
    "warm_buckets": [{"x": [1, 3, 48, 192]}],
}


def upload(client, name: str, data: bytes, config: dict | None = None, *, wait_probe: bool = True, **params):
    """PUT the model; once it is served, wait for its padding probe (which runs after the upload answers)
    unless ``wait_probe`` is False. The answer is the upload's own, from before the probe's verdicts."""
    files = {"model": ("model.onnx", data, "application/octet-stream")}
    if config is not None:
        files["config"] = ("config.json", json.dumps(config), "application/json")
    response = client.put(f"/models/{name}", files=files, params=params)
    if wait_probe and response.status_code in (200, 201):
        probed(client, name)
    return response


def probed(client, model: str, timeout: float = 180) -> dict:
    """The model's description once its padding probe is done: its verdicts, warm buckets and batching in
    force."""

    def ended():
        described = client.get(f"/models/{model}").json()
        return described if described["padding_probe"]["state"] not in ("pending", "running") else None

    described = wait_until(ended, timeout=timeout, what=f"{model}'s padding probe")
    assert described["padding_probe"]["state"] == "done", described["padding_probe"]
    return described


def bucket_state(client, model: str, label: str) -> str | None:
    for bucket in client.get(f"/models/{model}").json()["buckets"]:
        if bucket["bucket"] == label:
            return bucket["state"]
    return None


def settled_bucket(client, model: str, label: str | None = None, timeout: float = 180) -> dict:
    """The bucket (``label``, else the first to settle) once it is ready or failed."""

    def find():
        buckets = client.get(f"/models/{model}").json()["buckets"]
        found = [b for b in buckets if label is None or b["bucket"] == label]
        return next((b for b in found if b["state"] in ("ready", "failed")), None)

    return wait_until(find, timeout=timeout, what=f"{model} {label or 'a bucket'} to settle")


def wait_ready(client, model: str, label: str) -> None:
    bucket = settled_bucket(client, model, label)
    assert bucket["state"] == "ready", client.get(f"/models/{model}").json()


def predict(client, model: str, x: np.ndarray) -> dict:
    response = client.post("/predict", json={"model": model, "inputs": {"x": x.tolist()}})
    assert response.status_code == 200, response.text
    return response.json()


def metrics(client) -> str:
    return client.get("/metrics").text


@pytest.mark.slow
def test_cls_buckets_jit_metrics_and_restart(tmp_path):
    model_path = rapidocr_model(CLS)
    data = model_path.read_bytes()
    reference = OrtEngine(data)
    output = reference.output_names[0]
    rng = np.random.default_rng(7)
    batches = {n: rng.standard_normal((n, 3, 48, 192)).astype(np.float32) for n in (1, 3, 5)}
    expected_bucket = {1: "x=1x3x48x192", 3: "x=4x3x48x192", 5: "x=8x3x48x192"}

    # routing=compiled: serve by the verified kernel whenever there is one, to exercise that path
    # (measured routing would pick ONNX Runtime here: untuned TVM is slower on this model).
    server = ServerProcess(tmp_path / "data", routing="compiled").start()
    try:
        with server.client() as client:
            created = upload(client, "cls", data, CLS_CONFIG)
            assert created.status_code == 201, created.text
            axes = client.get("/models/cls").json()["axes"]
            assert axes["x:0"]["padding_safety"]["safe"] is True
            assert axes["x:0"]["effective_policy"] == "pow2"
            assert axes["x:3"]["padding_safety"]["safe"] is False  # global pooling sees the padding
            assert axes["x:3"]["effective_policy"] == "dynamic"  # its warm width 192 keeps a static kernel

            wait_ready(client, "cls", "x=1x3x48x192")
            engines = {}
            for n, x in batches.items():
                first = predict(client, "cls", x)
                assert first["bucket"] == expected_bucket[n]
                if n != 1:  # a new bucket: answered at once by ONNX Runtime, compiled meanwhile
                    assert first["engine"] == "onnxruntime"
                    wait_ready(client, "cls", expected_bucket[n])
                second = predict(client, "cls", x)
                assert second["engine"] == "tvm"
                engines[n] = (first["engine"], second["engine"])
                want = reference.run({"x": x})[output]
                for answer in (first, second):
                    got = np.asarray(answer["outputs"][output], dtype=np.float32)
                    assert got.shape == (n, 2)  # cut back from the padded bucket
                    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)

            text = metrics(client)
            assert metric_value(text, "jitserve_compiles_total", model="cls", outcome="ok") == 3
            assert metric_value(text, "jitserve_compile_duration_seconds_count", model="cls") == 3
            assert metric_value(text, "jitserve_recompiles_total", model="cls") == 0
            assert metric_value(text, "jitserve_unscheduled_kernels_total", model="cls") == 0  # a rule took each
            assert "jitserve_unscheduled_kernels_total" in text
            assert metric_value(text, "jitserve_requests_total", model="cls", engine="tvm", code="200") == 4
            assert metric_value(text, "jitserve_requests_total", model="cls", engine="onnxruntime", code="200") == 2
            # Padding waste: batch 3 in bucket 4 wastes 1/4, batch 5 in bucket 8 wastes 3/8.
            assert metric_value(text, "jitserve_padding_waste_ratio_count", model="cls") == 4
            waste = metric_value(text, "jitserve_padding_waste_ratio_sum", model="cls")
            assert waste == pytest.approx(0.25 + 0.375, abs=1e-6)
            assert metric_value(text, "jitserve_kernel_cache_entries") == 3
            assert metric_value(text, "jitserve_compile_queue_depth") == 0

        server.restart()
        with server.client() as client:
            wait_until(lambda: client.get("/readyz").status_code == 200, what="warm bucket after restart")
            for n, x in batches.items():
                answer = predict(client, "cls", x)
                assert answer["engine"] == "tvm", f"batch {n} after restart: {answer['engine']}"
                assert answer["bucket"] == expected_bucket[n]
            text = metrics(client)
            assert metric_value(text, "jitserve_compiles_total") == 0
            # Every bucket comes back from the store: the warm one at start, 4 and 8 on first use.
            assert metric_value(text, "jitserve_kernel_reloads_total", model="cls") == 3
            described = client.get("/models/cls").json()
            assert described["version"] == 1
            assert {b["bucket"]: b["state"] for b in described["buckets"]} == {
                label: "ready" for label in expected_bucket.values()
            }
    finally:
        server.stop()


def test_eviction_replace_and_missing_artifact_recompile(tmp_path):
    config = {"axes": {"batch": {"kind": "pow2", "min": 1, "max": 8}}, "probe_sizes": {"batch": 3}}
    data = synthetic.two_input_model()
    server = ServerProcess(tmp_path / "data", kernel_cache_entries=1, routing="compiled").start()

    def ask(client, n: int) -> dict:
        x = np.ones((n, 8), dtype=np.float32)
        response = client.post("/models/two/predict", json={"inputs": {"a": x.tolist(), "b": x.tolist()}})
        assert response.status_code == 200, response.text
        return response.json()

    try:
        with server.client() as client:
            assert upload(client, "two", data, config).status_code == 201
            assert ask(client, 1)["engine"] == "onnxruntime"
            wait_ready(client, "two", "a=1x8,b=1x8")
            assert ask(client, 3)["engine"] == "onnxruntime"
            wait_ready(client, "two", "a=4x8,b=4x8")
            # The cache holds one kernel: bucket 1 was evicted and comes back by reload.
            assert ask(client, 1)["engine"] == "tvm"
            text = metrics(client)
            assert metric_value(text, "jitserve_kernel_cache_evictions_total") >= 1
            assert metric_value(text, "jitserve_kernel_reloads_total", model="two") >= 1
            assert metric_value(text, "jitserve_compiles_total", model="two") == 2
            assert metric_value(text, "jitserve_kernel_cache_entries") == 1

            replaced = upload(client, "two", variant(data, "v2"), config, replace="true")
            assert replaced.status_code == 201, replaced.text
            assert replaced.json()["version"] == 2
            assert ask(client, 1)["engine"] == "onnxruntime"  # until the new version's weights are prepared
            # Same graph, new bytes: the version reuses the stored kernels (keyed by the graph), 0 compiles.
            wait_ready(client, "two", "a=1x8,b=1x8")
            assert ask(client, 1)["engine"] == "tvm"
            text = metrics(client)
            assert metric_value(text, "jitserve_recompiles_total", model="two", reason="new_model_version") == 0
            assert metric_value(text, "jitserve_compiles_total", model="two") == 2

        server.stop()
        shutil.rmtree(server.data_dir / "kernels" / "artifacts")
        server.start()
        with server.client() as client:
            assert ask(client, 1)["engine"] == "onnxruntime"
            wait_ready(client, "two", "a=1x8,b=1x8")
            text = metrics(client)
            assert metric_value(text, "jitserve_recompiles_total", model="two", reason="artifact_missing") == 1
            assert metric_value(text, "jitserve_compiles_total", model="two", outcome="ok") == 1
    finally:
        server.stop()


def test_demo_model_answers_right_after_start(tmp_path):
    server = ServerProcess(tmp_path / "data", demo_model="true").start()
    try:
        with server.client() as client:
            response = client.post("/predict", json={"model": "demo", "inputs": {"x": [[1.0, 2.0, 3.0, 4.0]]}})
            assert response.status_code == 200, response.text
            probs = response.json()["outputs"]["probs"]
            assert len(probs) == 1 and len(probs[0]) == 3
            assert sum(probs[0]) == pytest.approx(1.0, abs=1e-5)
            # The engine's share of the request comes as a header, not in the body.
            name, duration = response.headers["server-timing"].split(";dur=")
            assert name == "inference" and float(duration) > 0
            assert set(response.json()) == {"model", "version", "outputs", "engine", "bucket"}
            wait_until(lambda: client.get("/readyz").status_code == 200, what="demo warm bucket")
            assert [m["name"] for m in client.get("/models").json()["models"]] == ["demo"]
    finally:
        server.stop()


def test_replace_under_concurrent_requests_drops_none(tmp_path):
    """Requests in flight finish on the old version; none fails across the swap."""
    data = synthetic.two_input_model()
    server = ServerProcess(tmp_path / "data", compile_workers=0).start()
    x = np.ones((2, 8), dtype=np.float32).tolist()
    statuses, versions, stop = [], [], threading.Event()

    def hammer():
        with server.client() as client:
            while not stop.is_set():
                response = client.post("/models/two/predict", json={"inputs": {"a": x, "b": x}})
                statuses.append(response.status_code)
                if response.status_code == 200:
                    versions.append(response.json()["version"])

    try:
        with server.client() as client:
            assert upload(client, "two", data).status_code == 201
            threads = [threading.Thread(target=hammer) for _ in range(3)]
            for thread in threads:
                thread.start()
            wait_until(lambda: len(versions) >= 10, what="requests on version 1")
            assert upload(client, "two", variant(data, "v2"), replace="true").json()["version"] == 2
            count = len(versions)
            wait_until(lambda: len(versions) >= count + 10, what="requests on version 2")
            stop.set()
            for thread in threads:
                thread.join()
    finally:
        stop.set()
        server.stop()
    assert set(statuses) == {200}
    assert versions[0] == 1 and versions[-1] == 2
    assert set(versions) == {1, 2}


@pytest.mark.slow
def test_measured_routing_serves_each_bucket_with_its_fastest_engine(tmp_path):
    data = rapidocr_model(CLS).read_bytes()
    x = np.random.default_rng(3).standard_normal((1, 3, 48, 192)).astype(np.float32)
    server = ServerProcess(tmp_path / "data").start()  # routing=measured is the default
    try:
        with server.client() as client:
            assert upload(client, "cls", data, CLS_CONFIG).status_code == 201
            wait_ready(client, "cls", "x=1x3x48x192")
            bucket = client.get("/models/cls").json()["buckets"][0]
            assert bucket["state"] == "ready"
            latency = bucket["latency_ms"]
            assert set(latency) == {"onnxruntime", "tvm"} and all(v > 0 for v in latency.values())
            fastest = min(latency, key=latency.get)
            assert bucket["engine"] == fastest
            assert predict(client, "cls", x)["engine"] == fastest
            text = metrics(client)
            assert metric_value(text, "jitserve_routing_decisions_total", model="cls", engine=fastest) == 1

        # The measured route survives a restart without measuring again.
        server.restart()
        with server.client() as client:
            wait_until(lambda: client.get("/readyz").status_code == 200, what="warm bucket after restart")
            bucket = client.get("/models/cls").json()["buckets"][0]
            assert bucket["latency_ms"] == latency and bucket["engine"] == fastest
            assert predict(client, "cls", x)["engine"] == fastest
            text = metrics(client)
            assert metric_value(text, "jitserve_routing_decisions_total") == 0
            assert metric_value(text, "jitserve_compiles_total") == 0
    finally:
        server.stop()


@pytest.mark.slow
def test_a_bucket_under_concurrent_load_is_routed_by_throughput(tmp_path):
    """Requests to the bucket ran side by side before it compiled: its engines are timed with
    that many callers at once, and the one serving the most requests per second wins."""
    data = synthetic.slow_model(layers=4, width=512, compilable=True)
    config = {"axes": {"batch": {"kind": "pow2", "min": 1, "max": 64}}}
    x = np.random.default_rng(4).standard_normal((64, 4)).astype(np.float32).tolist()
    server = ServerProcess(tmp_path / "data").start()
    stop = threading.Event()
    statuses: list[int] = []

    def hammer() -> None:
        with server.client() as own:
            while not stop.is_set():
                statuses.append(own.post("/predict", json={"model": "mlp", "inputs": {"x": x}}).status_code)

    callers = [threading.Thread(target=hammer) for _ in range(4)]
    try:
        with server.client() as client:
            assert upload(client, "mlp", data, config).status_code == 201
            for thread in callers:
                thread.start()
            bucket = settled_bucket(client, "mlp", "x=64x4")
            stop.set()
            for thread in callers:
                thread.join()
            assert bucket["state"] == "ready", bucket
            assert bucket["peak_concurrency"] >= 2
            assert bucket["routed_by"] == "throughput", bucket
            rates = bucket["throughput_rps"]
            assert set(rates) == {"onnxruntime", "tvm"} and all(v > 0 for v in rates.values())
            assert bucket["engine"] == max(rates, key=rates.get)
            assert set(bucket["latency_ms"]) == {"onnxruntime", "tvm"}  # still measured, and shown
    finally:
        stop.set()
        server.stop()
    assert set(statuses) == {200}
