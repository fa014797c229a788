"""Background tuning against a real server: hot swap under load, restart."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from compiler.demo import demo_model_bytes
from tests.integration.serverproc import ServerProcess, metric_value, wait_until
from tests.integration.test_serving import upload

pytestmark = pytest.mark.slow

TUNING = {
    "tune_min_hits": 5,
    "tuning_interval_seconds": 0.5,
    "tune_trials_per_bucket": 4,
    "tune_trials_per_task": 2,
    "routing_runs": 5,
    "routing": "compiled",  # the tuned kernel serves once verified: the swap is observable
}
LABEL = "x=8x4"


def bucket(client) -> dict:
    return next((b for b in client.get("/models/mlp").json()["buckets"] if b["bucket"] == LABEL), {})


def test_tuned_kernel_hot_swaps_under_load_and_survives_restart(tmp_path):
    server = ServerProcess(tmp_path / "data", **TUNING).start()
    x = np.random.default_rng(5).standard_normal((8, 4)).astype(np.float32).tolist()
    statuses, engines, stop = [], [], threading.Event()

    def hammer():
        with server.client() as client:
            while not stop.is_set():
                response = client.post("/models/mlp/predict", json={"inputs": {"x": x}})
                statuses.append(response.status_code)
                if response.status_code == 200:
                    engines.append(response.json()["engine"])

    try:
        with server.client() as client:
            assert upload(client, "mlp", demo_model_bytes()).status_code == 201
            threads = [threading.Thread(target=hammer) for _ in range(2)]
            for thread in threads:
                thread.start()
            wait_until(lambda: (bucket(client).get("tuning") or {}).get("state") in ("done", "failed"), 300)
            swapped_at = len(engines)
            wait_until(lambda: len(engines) > swapped_at + 20, what="requests after the swap")
            stop.set()
            for thread in threads:
                thread.join()

            tuned = bucket(client)
            assert tuned["tuning"]["state"] == "done", tuned
            assert tuned["tuning"]["trials"] >= 1
            assert tuned["tuning"]["best_ms"] > 0  # reported live by the tuning child's measure callback
            latency = tuned["latency_ms"]
            assert set(latency) == {"onnxruntime", "tvm", "tvm-tuned"}
            assert tuned["engine"] == "tvm-tuned"
            text = client.get("/metrics").text
            assert metric_value(text, "jitserve_tuning_trials_total", model="mlp") >= 1
            assert metric_value(text, "jitserve_tuning_seconds_total", model="mlp") > 0
            assert metric_value(text, "jitserve_compiles_total", model="mlp", tier="tvm-tuned", outcome="ok") == 1
        assert set(statuses) == {200}, "a request failed across the hot swap"
        assert set(engines) <= {"onnxruntime", "tvm", "tvm-tuned"}
        after = engines[swapped_at + 2 :]  # a request or two may have started before the swap
        assert after and set(after) == {"tvm-tuned"}, "the tuned kernel did not serve after the swap"
        assert (server.data_dir / "kernels" / "tuning" / "database_tuning_record.json").stat().st_size > 0

        server.restart()
        with server.client() as client:
            for _ in range(10):
                response = client.post("/models/mlp/predict", json={"inputs": {"x": x}})
                assert response.json()["engine"] == tuned["engine"]
            restored = bucket(client)
            assert restored["tuning"]["state"] == "done" and restored["latency_ms"] == latency
            text = client.get("/metrics").text
            assert metric_value(text, "jitserve_compiles_total") == 0
            assert metric_value(text, "jitserve_tuning_trials_total") == 0
    finally:
        stop.set()
        server.stop()
