"""Uploads of models as real exporters write them, against a real server under
default settings: external data (multipart ``data`` parts, a .zip, a .tar),
and a model over the old 64 MiB limit."""

from __future__ import annotations

import io
import tarfile
import zipfile

import numpy as np
import pytest

from compiler.running.engines import OrtEngine
from tests import synthetic
from tests.compiler.test_upload import save_with_external_data
from tests.integration.serverproc import ServerProcess

INPUTS = {"a": np.ones((2, 8), np.float32), "b": np.full((2, 8), 2, np.float32)}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = ServerProcess(tmp_path_factory.mktemp("uploads") / "data", compile_workers=0).start()
    yield server
    server.stop()


def predicts_like(client, name: str, data: bytes) -> None:
    body = {"model": name, "inputs": {k: v.tolist() for k, v in INPUTS.items()}}
    response = client.post("/predict", json=body)
    assert response.status_code == 200, response.text
    np.testing.assert_allclose(response.json()["outputs"]["y"], OrtEngine(data).run(INPUTS)["y"], rtol=1e-6)


def test_external_data_as_multipart_data_parts(server, tmp_path):
    data = synthetic.two_input_model()
    (tmp_path / "weights").mkdir()
    model_path = save_with_external_data(tmp_path, data, location="weights/model.onnx.data")
    files = [
        ("model", ("model.onnx", model_path.read_bytes())),
        ("data", ("weights/model.onnx.data", (tmp_path / "weights" / "model.onnx.data").read_bytes())),
    ]
    with server.client() as client:
        assert client.put("/models/ext", files=files).status_code == 201
        predicts_like(client, "ext", data)
        missing = client.put("/models/ext2", files=files[:1])
        assert missing.status_code == 422
        assert "'weights/model.onnx.data' that is not in the upload" in missing.json()["error"]
        escaping = client.put("/models/ext3", files=[files[0], ("data", ("../x.data", b"0000"))])
        assert escaping.status_code == 400 and "inside the upload" in escaping.json()["error"]


@pytest.mark.parametrize("kind", ["zip", "tar"])
def test_external_data_as_an_archive_of_the_model_folder(server, tmp_path, kind):
    data = synthetic.two_input_model()
    save_with_external_data(tmp_path / "exported", data)
    buffer = io.BytesIO()
    if kind == "zip":
        with zipfile.ZipFile(buffer, "w") as bundle:
            for path in (tmp_path / "exported").iterdir():
                bundle.write(path, f"exported/{path.name}")
    else:
        with tarfile.open(fileobj=buffer, mode="w") as bundle:
            bundle.add(tmp_path / "exported", arcname="exported")
    with server.client() as client:
        response = client.put(f"/models/{kind}", content=buffer.getvalue())
        assert response.status_code == 201, response.text
        predicts_like(client, kind, data)


def test_a_model_over_64_mib_uploads_under_the_default_limit(server):
    data = synthetic.embedding_model(vocab=17_000, dim=1024)  # a 70 MB embedding table
    assert len(data) > 64 * 1024 * 1024
    ids = [[1, 16_999, 0, 5]]
    with server.client() as client:
        assert client.put("/models/big", content=data).status_code == 201
        response = client.post("/predict", json={"model": "big", "inputs": {"ids": ids}})
        assert response.status_code == 200, response.text
        want = OrtEngine(data).run({"ids": np.asarray(ids, dtype=np.int64)})["y"]
        np.testing.assert_allclose(response.json()["outputs"]["y"], want, rtol=1e-6)
        refused = client.post("/predict", json={"model": "big", "inputs": {"ids": [[17_000]]}})
        assert refused.status_code == 400
