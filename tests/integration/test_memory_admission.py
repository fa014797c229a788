"""Memory-aware admission against a real server: an upload whose weights cannot fit beside what is
served is refused with 507 and a JSON error naming the sizes, and loses nothing."""

from __future__ import annotations

import numpy as np

from tests import synthetic
from tests.integration.serverproc import ServerProcess, metric_value
from tests.integration.test_serving import predict, upload

LIMIT = 512 * 2**20


def test_an_upload_past_the_memory_limit_is_refused_and_the_server_serves_on(tmp_path):
    heavy = synthetic.heavy_model(200 * 2**20)  # needs about 600 MiB served: past the limit whatever else is held
    small = synthetic.bert_encoder_model(layers=1, hidden=64, heads=4, seq=16)
    process = ServerProcess(tmp_path / "data", memory_bytes=LIMIT).start()
    try:
        with process.client() as http:
            response = upload(http, "heavy", heavy)
            assert response.status_code == 507, response.text
            error = response.json()["error"]
            assert "'heavy' does not fit in memory" in error and "200 MiB of weights" in error, error
            assert "512 MiB" in error and "JITSERVE_MEMORY_BYTES" in error
            assert http.get("/models/heavy").status_code == 404
            assert not (tmp_path / "data" / "models" / "heavy").exists()  # nothing stored, nothing half-written
            text = http.get("/metrics").text
            assert metric_value(text, "jitserve_uploads_refused_for_memory_total") == 1
            assert metric_value(text, "jitserve_memory_limit_bytes") == LIMIT

            assert upload(http, "small", small).status_code == 201  # what fits is served
            assert predict(http, "small", np.zeros((1, 16, 64), np.float32))["engine"] == "onnxruntime"
            assert http.get("/healthz").status_code == 200
    finally:
        process.stop()


def test_a_stored_model_past_the_limit_is_skipped_at_start_and_refused_on_load(tmp_path):
    heavy = synthetic.heavy_model(200 * 2**20)
    unlimited = ServerProcess(tmp_path / "data", memory_bytes=0).start()
    try:
        with unlimited.client() as http:
            assert upload(http, "heavy", heavy).status_code == 201
    finally:
        unlimited.stop()

    limited = ServerProcess(tmp_path / "data", memory_bytes=LIMIT).start()  # the same store, less memory
    try:
        with limited.client() as http:
            assert http.get("/readyz").status_code == 200
            assert http.get("/models/heavy").status_code == 404  # skipped, not served
            index = http.post("/v2/repository/index").json()
            assert [(m["name"], m["state"]) for m in index] == [("heavy", "UNAVAILABLE")]  # still stored
            response = http.post("/v2/repository/models/heavy/load")
            assert response.status_code == 507 and "does not fit in memory" in response.json()["error"]
        assert "cannot serve stored model heavy" in limited.log_path.read_text()
    finally:
        limited.stop()
