"""Dynamic batching against a real server: joined runs equal separate ones, groups follow the
buckets, /predict and the V2 protocol share one batcher, a failing request fails alone, and an
upload says why a model cannot batch."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
import tritonclient.http as triton

from compiler.running.engines import OrtEngine
from tests import synthetic
from tests.integration.serverproc import ServerProcess, metric_value
from tests.integration.test_serving import upload, wait_ready

PATIENT = 10_000_000  # us, the most allowed: only a full (preferred) batch goes before the test ends


def batch_metrics(client, model: str) -> tuple[float, float]:
    """(runs, rows) of the model's batched runs."""
    text = client.get("/metrics").text
    return (
        metric_value(text, "jitserve_batch_size_count", model=model),
        metric_value(text, "jitserve_batch_size_sum", model=model),
    )


@pytest.mark.slow
def test_joined_requests_run_once_on_the_kernel_and_equal_separate_runs(tmp_path):
    config = {
        "axes": {"batch": {"kind": "pow2", "min": 1, "max": 8}, "seq": {"kind": "pow2", "min": 1, "max": 16}},
        "warm_buckets": [{"x": [8, 8]}],
        "dynamic_batching": {"max_batch_size": 8, "max_queue_delay_us": PATIENT, "preferred_batch_sizes": [8]},
    }
    server = ServerProcess(tmp_path / "data", routing="compiled").start()
    try:
        with server.client() as client:
            response = upload(client, "relu", synthetic.relu_model(["batch", "seq"]), config)
            assert response.status_code == 201, response.text
            assert client.get("/models/relu").json()["dynamic_batching"] == {  # the probe found batch safe
                "enabled": True,
                "reason": "requests are joined along axis 'batch'",
                "max_batch_size": 8,
                "max_queue_delay_us": PATIENT,
                "preferred_batch_sizes": [8],
                "groups": [],
            }
            wait_ready(client, "relu", "x=8x8")
            rng = np.random.default_rng(3)
            # 1 + 3 + 2 + 2 rows, every seq in the bucket of 8: one group, one run of 8 rows.
            inputs = [rng.standard_normal(shape).astype(np.float32) for shape in ((1, 5), (3, 7), (2, 8), (2, 6))]

            def ask(x):
                return client.post("/predict", json={"model": "relu", "inputs": {"x": x.tolist()}}).json()

            with concurrent.futures.ThreadPoolExecutor(len(inputs)) as pool:
                answers = list(pool.map(ask, inputs))
            for x, answer in zip(inputs, answers, strict=True):
                assert (answer["engine"], answer["bucket"]) == ("tvm", "x=8x8"), answer
                np.testing.assert_array_equal(np.asarray(answer["outputs"]["y"], np.float32), np.maximum(x, 0))
            assert batch_metrics(client, "relu") == (1, 8)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = ServerProcess(tmp_path_factory.mktemp("batching") / "data", compile_workers=0).start()
    yield server
    server.stop()


def test_predict_and_v2_share_the_batcher_and_a_bad_request_fails_alone(server):
    config = {"dynamic_batching": {"max_batch_size": 8, "max_queue_delay_us": PATIENT, "preferred_batch_sizes": [3]}}
    model = synthetic.gather_rows_model()
    reference = OrtEngine(model)
    with server.client() as client:
        assert upload(client, "rows", model, config).status_code == 201

        def by_predict(index: int):
            return client.post("/predict", json={"model": "rows", "inputs": {"idx": [[index]]}})

        def by_v2(index: int):
            v2 = triton.InferenceServerClient(f"127.0.0.1:{server.port}")
            tensor = triton.InferInput("idx", [1, 1], "INT64")
            tensor.set_data_from_numpy(np.array([[index]], np.int64), binary_data=True)
            try:
                return v2.infer("rows", [tensor]).as_numpy("y")
            finally:
                v2.close()

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            good = pool.submit(by_predict, 1)
            binary = pool.submit(by_v2, 2)
            bad = pool.submit(by_predict, 20)  # out of the table's 10 rows: only ONNX Runtime tells
            answers = good.result(timeout=15), binary.result(timeout=15), bad.result(timeout=15)

        want = reference.run({"idx": np.array([[1], [2]], np.int64)})["y"]
        assert answers[0].status_code == 200, answers[0].text
        np.testing.assert_allclose(answers[0].json()["outputs"]["y"], want[:1], rtol=1e-6)
        np.testing.assert_allclose(answers[1], want[1:], rtol=1e-6)
        assert answers[2].status_code == 400
        assert "invalid index" in answers[2].json()["error"]
        assert batch_metrics(client, "rows") == (1, 3)  # the three joined once; the retries ran alone
        text = client.get("/metrics").text
        assert metric_value(text, "jitserve_batch_queue_delay_seconds_count", model="rows") == 3


def test_an_upload_says_why_a_model_cannot_batch(server):
    batching = {"dynamic_batching": {"max_batch_size": 4}}
    with server.client() as client:
        response = upload(client, "mix", synthetic.batch_mix_model(), batching)
        assert response.status_code == 201, response.text
        described = client.get("/models/mix").json()["dynamic_batching"]  # the probe's verdict, after it
        assert described["enabled"] is False
        assert described["reason"].startswith("axis 'batch' is not verified padding-safe: padding changes the outputs")
        x = [[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 1.0]]
        answer = client.post("/predict", json={"model": "mix", "inputs": {"x": x}}).json()
        np.testing.assert_allclose(answer["outputs"]["y"], np.asarray(x) - np.mean(x, axis=0), rtol=1e-6)
        assert batch_metrics(client, "mix") == (0, 0)

        too_big = {"axes": {"batch": {"kind": "pow2", "max": 4}}, "dynamic_batching": {"max_batch_size": 8}}
        response = upload(client, "big", synthetic.add_model(), too_big)
        assert response.status_code == 400
        assert response.json()["error"] == (
            "config dynamic_batching.max_batch_size 8 is beyond the largest bucket of axis 'batch' (4)"
        )
        assert upload(client, "plain", synthetic.add_model()).json()["dynamic_batching"] is None
