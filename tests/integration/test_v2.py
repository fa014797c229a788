"""The Open Inference Protocol against a real server, driven by a real V2
client (Triton's ``tritonclient.http``): metadata, health, readiness, infer
with JSON and binary tensors, errors."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from compiler.models.demo import demo_model_bytes
from compiler.running.engines import OrtEngine
from tests import synthetic
from tests.integration.serverproc import ServerProcess
from tests.integration.test_serving import upload

DEMO = demo_model_bytes()
REPO = Path(__file__).resolve().parents[2]
KSERVE_PYTHON = REPO / ".cache" / "kserve-venv" / "bin" / "python"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = ServerProcess(tmp_path_factory.mktemp("v2") / "data", compile_workers=0).start()
    with server.client() as client:
        assert upload(client, "demo", DEMO).status_code == 201
        assert upload(client, "add64", synthetic.add_model("int64")).status_code == 201
    yield server
    server.stop()


@pytest.fixture
def client(server):
    client = triton.InferenceServerClient(f"127.0.0.1:{server.port}")
    yield client
    client.close()


def test_server_and_model_metadata(client):
    assert client.is_server_live() and client.is_server_ready()
    metadata = client.get_server_metadata()
    assert metadata["name"] == "jitserve"
    assert {"binary_tensor_data", "model_repository"} <= set(metadata["extensions"])
    assert client.is_model_ready("demo") and client.is_model_ready("demo", "1")
    model = client.get_model_metadata("demo")
    assert model["versions"] == ["1"]
    assert model["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    assert model["outputs"] == [{"name": "probs", "datatype": "FP32", "shape": [-1, 3]}]
    assert not client.is_model_ready("nope")


@pytest.mark.parametrize(("binary_in", "binary_out"), [(False, False), (True, True), (True, False), (False, True)])
def test_infer_json_and_binary(client, binary_in, binary_out):
    x = np.random.default_rng(4).standard_normal((3, 4)).astype(np.float32)
    tensor = triton.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=binary_in)
    result = client.infer(
        "demo", [tensor], outputs=[triton.InferRequestedOutput("probs", binary_data=binary_out)], request_id="r-7"
    )
    np.testing.assert_allclose(result.as_numpy("probs"), OrtEngine(DEMO).run({"x": x})["probs"], rtol=1e-6)
    response = result.get_response()
    assert (response["model_name"], response["model_version"], response["id"]) == ("demo", "1", "r-7")


def test_integer_tensors_and_all_outputs_by_default(client):
    x = np.arange(8, dtype=np.int64).reshape(2, 4)
    tensor = triton.InferInput("x", [2, 4], "INT64")
    tensor.set_data_from_numpy(x)
    result = client.infer("add64", [tensor])
    np.testing.assert_array_equal(result.as_numpy("y"), x + x)
    assert result.as_numpy("y").dtype == np.int64


def test_errors_come_back_with_their_status(client, server):
    x = np.ones((1, 4), np.float64)
    wrong = triton.InferInput("x", [1, 4], "FP64")
    wrong.set_data_from_numpy(x)
    with pytest.raises(InferenceServerException, match="datatype 'FP64'; the model takes FP32") as error:
        client.infer("demo", [wrong])
    assert error.value.status() == "400"
    right = triton.InferInput("x", [1, 4], "FP32")
    right.set_data_from_numpy(x.astype(np.float32))
    with pytest.raises(InferenceServerException, match="model 'nope' not found") as error:
        client.infer("nope", [right])
    assert error.value.status() == "404"
    with pytest.raises(InferenceServerException, match="no version '7'"):
        client.infer("demo", [right], model_version="7")

    head = orjson.dumps(
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "parameters": {"binary_data_size": 12}}]}
    )
    cases = {
        "size mismatch": (head + b"\0" * 12, len(head), "binary_data_size 12 is not the 16 bytes"),
        "extra bytes": (
            head.replace(b"12", b"16") + b"\0" * 20,
            len(head),
            "4 bytes of binary data no input claims",
        ),
        "short body": (head.replace(b"12", b"16") + b"\0" * 8, len(head), "ends before its 16 bytes"),
        "bad header": (head, len(head) + 99, "does not fit the body"),
    }
    with httpx.Client(base_url=server.url) as http:
        for what, (body, length, message) in cases.items():
            response = http.post(
                "/v2/models/demo/infer", content=body, headers={"inference-header-content-length": str(length)}
            )
            assert response.status_code == 400, what
            assert message in response.json()["error"], (what, response.json())
        shape = http.post(
            "/v2/models/demo/infer", json={"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 4], "data": [1]}]}
        )
        assert shape.status_code == 400 and "has 1 values, shape [2, 4] needs 8" in shape.json()["error"]


def test_model_repository_index_unload_and_load(client, server):
    index = {entry["name"]: entry for entry in client.get_model_repository_index()}
    assert index["demo"] == {"name": "demo", "version": "1", "state": "READY", "reason": ""}
    client.unload_model("add64")
    assert not client.is_model_ready("add64")
    index = {entry["name"]: entry for entry in client.get_model_repository_index()}
    assert index["add64"]["state"] == "UNAVAILABLE"  # still stored
    with pytest.raises(InferenceServerException) as error:
        client.infer("add64", [])
    assert error.value.status() == "404", error.value.message()
    client.load_model("add64")
    assert client.is_model_ready("add64")
    tensor = triton.InferInput("x", [1, 4], "INT64")
    tensor.set_data_from_numpy(np.ones((1, 4), np.int64))
    np.testing.assert_array_equal(client.infer("add64", [tensor]).as_numpy("y"), [[2, 2, 2, 2]])
    client.load_model("add64")  # loading a served model changes nothing
    with pytest.raises(InferenceServerException, match="no stored model 'nope'") as error:
        client.load_model("nope")
    assert error.value.status() == "404"


def test_repository_calls_need_the_admin_token(tmp_path):
    server = ServerProcess(tmp_path / "data", compile_workers=0, admin_token="secret").start()
    try:
        with httpx.Client(base_url=server.url) as http:
            assert http.post("/v2/repository/index").status_code == 401
            assert http.post("/v2/repository/models/demo/unload").status_code == 401
            ok = http.post("/v2/repository/index", headers={"authorization": "Bearer secret"})
            assert ok.status_code == 200 and ok.json() == []
    finally:
        server.stop()


def run_kserve_client(script: str, target: str, model: str) -> dict:
    """One of KServe's clients (``tests/integration/<script>``) run in KServe's environment; what it printed."""
    if not KSERVE_PYTHON.exists():
        message = "KServe's client is not installed: make test installs it into .cache/kserve-venv"
        pytest.fail(message)  # a green run means every test ran: never a silent skip
    run = subprocess.run(
        [str(KSERVE_PYTHON), f"tests/integration/{script}", target, model],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


def test_kserve_rest_client_json_and_binary(server):
    found = run_kserve_client("kserve_client.py", server.url, "demo")
    assert (found["live"], found["ready"], found["model_ready"]) == (True, True, True)
    want = OrtEngine(DEMO).run({"x": np.asarray(found["input"], np.float32)})["probs"]
    for kind in ("json", "binary"):
        assert (found[kind]["id"], found[kind]["model_name"]) == (f"kserve-{kind == 'binary'}", "demo")
        np.testing.assert_allclose(found[kind]["probs"], want, rtol=1e-6)


def test_default_limit_carries_eight_640x640_images_as_binary(client, server):
    with server.client() as http:
        model = synthetic.relu_model(["batch", 3, 640, 640])
        assert upload(http, "relu640", model, {"probe_sizes": {"batch": 2}}).status_code == 201
    x = np.random.default_rng(8).standard_normal((8, 3, 640, 640)).astype(np.float32)  # 39.3 MB
    tensor = triton.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=True)
    result = client.infer("relu640", [tensor], outputs=[triton.InferRequestedOutput("y", binary_data=True)])
    np.testing.assert_array_equal(result.as_numpy("y"), np.maximum(x, 0))


def test_infer_limit_enforced_while_reading(tmp_path):
    small = ServerProcess(tmp_path / "data", compile_workers=0, max_infer_bytes=1000).start()
    try:
        with small.client() as http:
            assert upload(http, "add64", synthetic.add_model("int64")).status_code == 201
            x = np.ones((64, 4), np.int64)  # 2 kB of binary tensor
            entry = {"name": "x", "shape": [64, 4], "datatype": "INT64", "parameters": {"binary_data_size": 2048}}
            head = orjson.dumps({"inputs": [entry]})

            def chunks():  # no Content-Length: the server can only tell while reading
                yield head
                yield x.tobytes()

            headers = {"Inference-Header-Content-Length": str(len(head))}
            answer = http.post("/v2/models/add64/infer", content=chunks(), headers=headers)
            assert answer.status_code == 413
            assert answer.json() == {"error": "request body is over the limit of 1000 bytes"}
    finally:
        small.stop()
