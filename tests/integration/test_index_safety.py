"""Out-of-range indices never reach a kernel: against a real server whose
embedding buckets real TVM kernels serve, every such request answers 400
naming the valid range, and the process lives on."""

from __future__ import annotations

import numpy as np
import pytest

from compiler.running.engines import OrtEngine
from tests import synthetic
from tests.integration.serverproc import ServerProcess, metric_value
from tests.integration.test_serving import settled_bucket, upload, wait_ready

VOCAB = 50
CONFIG = {
    "axes": {"batch": {"kind": "pow2", "min": 1, "max": 8}, "seq": {"kind": "exact"}},
    "probe_sizes": {"batch": 3, "seq": 8},
    "warm_buckets": [{"ids": [1, 8]}, {"ids": [4, 8]}],
}
OUT_OF_RANGE = [999999, -40000, VOCAB, -VOCAB - 1]
RANGE = f"outside [-{VOCAB}, {VOCAB - 1}]"
GATHER = "Gather 'embedding'"


def ids(batch: int, bad: int | None = None) -> list[list[int]]:
    values = np.arange(batch * 8).reshape(batch, 8) % VOCAB
    if bad is not None:
        values[-1, -1] = bad
    return values.tolist()


@pytest.mark.slow
def test_out_of_range_ids_get_400_from_every_compiled_bucket_and_the_server_lives(tmp_path):
    data = synthetic.embedding_model(vocab=VOCAB)
    reference = OrtEngine(data)
    server = ServerProcess(tmp_path / "data", routing="compiled").start()
    try:
        with server.client() as client:
            assert upload(client, "emb", data, CONFIG).status_code == 201
            for label in ("ids=1x8", "ids=4x8"):
                wait_ready(client, "emb", label)
            for batch in (1, 3):
                answer = client.post("/predict", json={"model": "emb", "inputs": {"ids": ids(batch)}}).json()
                assert answer["engine"] == "tvm"
                want = reference.run({"ids": np.asarray(ids(batch), dtype=np.int64)})["y"]
                np.testing.assert_allclose(answer["outputs"]["y"], want, rtol=1e-4, atol=1e-5)
                for bad in OUT_OF_RANGE:
                    response = client.post("/predict", json={"model": "emb", "inputs": {"ids": ids(batch, bad)}})
                    assert response.status_code == 400, response.text
                    assert response.json() == {
                        "error": f"input 'ids' has values {RANGE}: it indexes Gather 'embedding'"
                    }
            assert server.process.poll() is None
            assert client.get("/healthz").status_code == 200
            still = client.post("/predict", json={"model": "emb", "inputs": {"ids": ids(1, VOCAB - 1)}})
            assert (still.status_code, still.json()["engine"]) == (200, "tvm")
            text = client.get("/metrics").text
            assert metric_value(text, "jitserve_requests_total", model="emb", code="400") == 2 * len(OUT_OF_RANGE)
    finally:
        server.stop()


def test_a_computed_index_is_never_compiled_and_onnxruntime_refusals_are_400(tmp_path):
    data = synthetic.embedding_model(vocab=VOCAB, computed_index=True)
    server = ServerProcess(tmp_path / "data", routing="compiled").start()
    try:
        with server.client() as client:
            assert upload(client, "shifted", data, CONFIG | {"warm_buckets": [{"ids": [1, 8]}]}).status_code == 201
            bucket = settled_bucket(client, "shifted")
            assert bucket["state"] == "failed"
            assert bucket["reason"].startswith("not compiled: input 'ids' reaches the index of Gather 'embedding'")
            ok = client.post("/predict", json={"model": "shifted", "inputs": {"ids": ids(1, VOCAB - 2)}})
            assert (ok.status_code, ok.json()["engine"]) == (200, "onnxruntime")
            refused = client.post("/predict", json={"model": "shifted", "inputs": {"ids": ids(1, VOCAB - 1)}})
            assert refused.status_code == 400
            assert refused.json()["error"].startswith(
                "onnxruntime refused the input: indices element out of data bounds"
            )
            assert metric_value(client.get("/metrics").text, "jitserve_compiles_total", model="shifted") == 0
    finally:
        server.stop()
