"""Every error a client can cause, over HTTP against a real ``python -m server``.

Each one answers ``{"error": "<message naming the problem>"}`` with its own
status, and none of them hurts the server: it keeps serving and leaves no
half-written model on disk.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from urllib.parse import quote

import httpx
import pytest

from tests import malformed, synthetic
from tests.integration.serverproc import ServerProcess, wait_until

MAX_MODEL_BYTES = 2000
MAX_PREDICT_BYTES = 1000
EXACT = {"axes": {"batch": {"kind": "exact"}}}


def assert_error(response: httpx.Response, status: int, *words: str) -> str:
    """The response is ``status`` with a JSON ``{"error": ...}`` naming every one of ``words``."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"}, body
    message = body["error"]
    assert isinstance(message, str) and message, body
    for word in words:
        assert word.lower() in message.lower(), f"{word!r} not in {message!r}"
    return message


def upload(client: httpx.Client, name: str, data: bytes, config: dict | None = None, **params) -> httpx.Response:
    if config is None:
        return client.put(f"/models/{name}", content=data, params=params)
    return client.put(
        f"/models/{name}", files={"model": ("model.onnx", data)}, data={"config": json.dumps(config)}, params=params
    )


def chunks(data: bytes, size: int = 256) -> Iterator[bytes]:
    """A body httpx can only send chunked: no Content-Length header."""
    for start in range(0, len(data), size):
        yield data[start : start + size]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    process = ServerProcess(
        tmp_path_factory.mktemp("errors") / "data",
        max_model_bytes=MAX_MODEL_BYTES,
        max_predict_bytes=MAX_PREDICT_BYTES,
        compile_queue_size=1,
        compile_workers=1,
    ).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with server.client() as client:
        for name, data in (
            ("add", synthetic.add_model("float32")),
            ("add_int", synthetic.add_model("int64")),
            ("two", synthetic.two_input_model()),
        ):
            assert upload(client, name, data).status_code == 201
        yield client


# -- 400 -------------------------------------------------------------------


def test_malformed_json_body(client):
    response = client.post("/predict", content=b'{"model": "add", "inputs": ')
    assert_error(response, 400, "malformed JSON")


def test_non_utf8_body(client):
    assert_error(client.post("/predict", content=b"\xff\xfe{}"), 400, "malformed JSON")


@pytest.mark.parametrize("body", [[1, 2], "add", 3, None])
def test_body_not_an_object(client, body):
    assert_error(client.post("/predict", content=json.dumps(body)), 400, "must be an object")


@pytest.mark.parametrize("body", [{"inputs": {"x": [[1, 2, 3, 4]]}}, {"model": 3, "inputs": {}}])
def test_missing_model(client, body):
    assert_error(client.post("/predict", json=body), 400, "missing 'model'")


def test_missing_inputs(client):
    assert_error(client.post("/predict", json={"model": "add"}), 400, "missing 'inputs'")
    assert_error(client.post("/models/add/predict", json={}), 400, "missing 'inputs'")


@pytest.mark.parametrize(
    ("model", "inputs", "words"),
    [
        ("add", [[1, 2, 3, 4]], ["'inputs' must be an object"]),
        ("add", {"x": [[1, 2, 3, 4]], "z": [[1]]}, ["unknown input 'z'", "'x'"]),
        ("two", {"a": [[0] * 8]}, ["missing input 'b'"]),
        ("add", {"x": [1, 2, 3, 4]}, ["'x'", "rank 1", "expected 2"]),
        ("add", {"x": [[[1, 2, 3, 4]]]}, ["'x'", "rank 3", "expected 2"]),
        ("add", {"x": [[1, 2, 3]]}, ["'x'", "axis 1 is 3", "fixes it at 4"]),
        ("add", {"x": [["a", "b", "c", "d"]]}, ["'x'", "numeric"]),
        ("add", {"x": [[1, 2, 3, 4], [1, 2]]}, ["'x'", "ragged"]),
        ("add", {"x": [[1, 2, 3, 4], 5]}, ["'x'", "ragged"]),
        ("add", {"x": 7}, ["'x'", "rank 0"]),
        ("add_int", {"x": [[1.5, 2, 3, 4]]}, ["'x'", "int64", "non-integer"]),
        ("add_int", {"x": [[2**63, 2, 3, 4]]}, ["'x'", "int64", "outside"]),
        ("add_int", {"x": [[1, 2, 3, -1e300]]}, ["'x'", "int64", "outside"]),
        ("two", {"a": [[0] * 8], "b": [[0] * 8] * 2}, ["'batch'", "'b'"]),
    ],
    ids=[
        "inputs-not-object",
        "unknown-input",
        "missing-input",
        "rank-too-low",
        "rank-too-high",
        "static-dim",
        "strings",
        "ragged",
        "ragged-scalar",
        "scalar",
        "float-into-int64",
        "int64-overflow",
        "int64-underflow",
        "axis-disagrees",
    ],
)
def test_bad_inputs(client, model, inputs, words):
    assert_error(client.post("/predict", json={"model": model, "inputs": inputs}), 400, *words)
    assert_error(client.post(f"/models/{model}/predict", json={"inputs": inputs}), 400, *words)


def test_integral_values_into_int64_are_fine(client):
    for x, y in (
        ([[1.0, 2.0, -3.0, 4]], [[2, 4, -6, 8]]),
        ([[1, 2**62 - 1, -(2**62), 4]], [[2, 2**63 - 2, -(2**63), 8]]),
    ):
        response = client.post("/models/add_int/predict", json={"inputs": {"x": x}})
        assert response.status_code == 200, response.text
        assert response.json()["outputs"] == {"y": y}


@pytest.mark.parametrize(
    "name",
    ["bad name!", "a" * 65, "caf\u00e9", "semi;colon", ".staging", ".hidden", "...", "-x", "_x"],
)
def test_invalid_model_name(client, name):
    response = client.put(f"/models/{quote(name, safe='')}", content=synthetic.add_model())
    assert_error(response, 400, "invalid model name")
    assert client.delete(f"/models/{quote(name, safe='')}").status_code in (400, 404)  # never a 500


@pytest.mark.parametrize("name", ["a" * 300, ".staging", "..", "caf\u00e9"])
def test_names_no_upload_could_take_are_never_stored(client, name):
    # a name longer than the file system's limit was a 500 OSError on the repository's load
    path = quote(name, safe="").replace(".", "%2E")  # ".." stays a name: not resolved away by the client
    for route in (f"/v2/repository/models/{path}/load", f"/v2/repository/models/{path}/unload"):
        assert client.post(route).status_code == 404
    assert client.get(f"/models/{path}").status_code == 404
    assert client.delete(f"/models/{path}").status_code in (400, 404)


@pytest.mark.parametrize("name", ["con", "NUL", "com1", "lpt9.onnx", "Aux"])
def test_reserved_device_names_are_refused(client, name):
    assert_error(client.put(f"/models/{name}", content=synthetic.add_model()), 400, "reserved device name")


@pytest.mark.parametrize("name", ["console", "nully", "com10", "a.b-c_d", "7up"])
def test_names_near_the_reserved_ones_are_fine(client, name):
    assert upload(client, name, synthetic.add_model()).status_code == 201
    assert client.delete(f"/models/{name}").status_code == 204


def test_longest_model_name_is_fine(client):
    name = "a" * 64
    assert upload(client, name, synthetic.add_model()).status_code == 201
    assert client.delete(f"/models/{name}").status_code == 204


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ("{not json", ["config part is not valid JSON"]),
        ("[1, 2]", ["config part must be a JSON object"]),
        (json.dumps({"bogus": 1}), ["invalid config", "bogus"]),
        (json.dumps({"axes": {"batch": {"kind": "nope"}}}), ["invalid config", "axes.batch.kind"]),
        (json.dumps({"axes": {"seq": {"kind": "exact"}}}), ["axis 'seq'", "batch"]),
        (json.dumps({"pad_values": {"q": 1}}), ["pad_values", "'q'"]),
        (json.dumps({"warm_buckets": [{"x": [1, 5]}]}), ["warm_buckets", "'x'"]),
        (json.dumps({"warm_buckets": [{"x": [-1, 4]}]}), ["invalid config", "warm_buckets"]),
        (json.dumps({"probe_sizes": {"batch": 0}}), ["invalid config", "probe_sizes.batch"]),
        (json.dumps({"probe_sizes": {"batch": 10**12}}), ["config probe_sizes", "input 'x'", "largest tensor"]),
        (json.dumps({"warm_buckets": [{"x": [10**12, 4]}]}), ["warm bucket x=1000000000000x4", "largest tensor"]),
        (
            json.dumps({"axes": {"batch": {"kind": "dynamic", "min": 1, "max": 10**12}}}),
            ["axes.batch dynamic max", "largest tensor"],
        ),
        ('{"rtol": 1e999}', ["invalid config at rtol", "finite"]),
        ('{"atol": 5}', ["invalid config at atol", "less than or equal to 1"]),
        ('{"pad_values": {"x": -1e999}}', ["invalid config at pad_values.x", "finite"]),
        ('{"axes": {"batch": {"approximate": 1e999}}}', ["invalid config at axes.batch.approximate", "finite"]),
    ],
    ids=[
        "not-json",
        "not-object",
        "unknown-field",
        "bad-policy",
        "unknown-axis",
        "unknown-pad-input",
        "bad-warm",
        "negative-warm",
        "zero-probe",
        "huge-probe",
        "huge-warm",
        "huge-dynamic-range",
        "infinite-rtol",
        "atol-past-range",
        "infinite-pad",
        "infinite-approximate",
    ],
)
def test_invalid_config(client, config, words):
    files = {"model": ("m.onnx", synthetic.add_model())}
    response = client.put("/models/configured", files=files, data={"config": config})
    assert_error(response, 400, *words)
    assert client.get("/models/configured").status_code == 404


def test_multipart_without_model_part(client):
    response = client.put("/models/configured", files={"onnx": ("m.onnx", synthetic.add_model())})
    assert_error(response, 400, "'model' part")


# -- 404 -------------------------------------------------------------------


def test_unknown_model(client):
    inputs = {"x": [[1, 2, 3, 4]]}
    assert_error(client.post("/predict", json={"model": "unknown", "inputs": inputs}), 404, "'unknown'", "not found")
    assert_error(client.post("/models/unknown/predict", json={"inputs": inputs}), 404, "'unknown'", "not found")
    assert_error(client.get("/models/unknown"), 404, "'unknown'", "not found")
    assert_error(client.delete("/models/unknown"), 404, "'unknown'", "not found")


def test_unknown_route_is_json_too(client):
    assert_error(client.get("/nowhere"), 404, "not found")
    assert_error(client.post("/healthz"), 405, "not allowed")


# -- 409 -------------------------------------------------------------------


def test_existing_name_needs_replace(client):
    first = upload(client, "dup", synthetic.add_model())
    assert first.status_code == 201, first.text
    assert first.json()["version"] == 1
    assert_error(upload(client, "dup", synthetic.add_model()), 409, "'dup'", "replace=true")
    assert client.get("/models/dup").json()["version"] == 1

    second = upload(client, "dup", synthetic.relu_model(["batch", 4]), replace="true")
    assert second.status_code == 201, second.text
    assert second.json()["version"] == 2
    assert second.json()["digest"] != first.json()["digest"]
    assert client.get("/models/dup").json()["version"] == 2
    response = client.post("/models/dup/predict", json={"inputs": {"x": [[-1, 2, -3, 4]]}})
    assert response.status_code == 200, response.text
    assert response.json()["version"] == 2
    assert response.json()["outputs"] == {"y": [[0, 2, 0, 4]]}


# -- 413 -------------------------------------------------------------------


def big_model() -> bytes:
    data = synthetic.slow_model(layers=1, width=32)  # a valid model of ~5 KB
    assert len(data) > MAX_MODEL_BYTES
    return data


def test_upload_over_the_limit(client):
    assert_error(upload(client, "big", big_model()), 413, "limit of 2000")
    assert_error(upload(client, "big", big_model(), config=EXACT), 413, "limit of 2000")
    assert client.get("/models/big").status_code == 404


def test_chunked_upload_over_the_limit(client):
    request = client.build_request("PUT", "/models/big", content=chunks(big_model()))
    assert "content-length" not in request.headers
    assert request.headers["transfer-encoding"] == "chunked"
    assert_error(client.send(request), 413, "limit of 2000")
    assert client.get("/models/big").status_code == 404


def test_chunked_upload_under_the_limit_is_fine(client):
    response = client.put("/models/chunked", content=chunks(synthetic.add_model(), size=16))
    assert response.status_code == 201, response.text
    assert client.delete("/models/chunked").status_code == 204


def test_predict_body_over_the_limit(client):
    body = json.dumps({"model": "add", "inputs": {"x": [[1, 2, 3, 4]] * 100}}).encode()
    assert len(body) > MAX_PREDICT_BYTES
    assert_error(client.post("/predict", content=body), 413, "limit of 1000")
    assert_error(client.post("/models/add/predict", content=chunks(body)), 413, "limit of 1000")


# -- 422 -------------------------------------------------------------------


CORPUS = malformed.corpus()


@pytest.mark.parametrize(
    ("entry", "words"),
    [
        ("garbage", ["not an ONNX model"]),
        ("empty", ["empty"]),
        ("truncated-half", ["ONNX model"]),
        ("external-data-relative", ["'W'", "external data", "../../etc/passwd"]),
        ("static-dim-1e12", ["input 'x'", "16000000000000 bytes", "largest tensor"]),
        ("constant-of-shape-4tb", ["tensor 'filled'", "4398046511104 bytes"]),
        ("invalid-utf8-op-type", ["utf-8", "can't decode byte 0xff"]),
        ("data-type-99", ["invalid tensor data type 99"]),
    ],
)
def test_invalid_model(client, entry, words):
    # the words the message names; tests/integration/test_hostile_input.py sends the whole corpus
    assert_error(upload(client, "broken", CORPUS[entry]), 422, *words)
    assert client.get("/models/broken").status_code == 404


# -- 503 -------------------------------------------------------------------


def test_compile_queue_full(client, server):
    # compile_queue_size=1: three warm buckets that exact policy keeps apart cannot all queue.
    config = EXACT | {"warm_buckets": [{"a": [n, 8], "b": [n, 8]} for n in (1, 2, 3)]}
    assert_error(upload(client, "warm", synthetic.two_input_model(), config), 503, "compile queue is full")
    assert_error(client.get("/models/warm"), 404, "'warm'")
    assert not (server.data_dir / "models" / "warm").exists()


@pytest.fixture
def one_slot_server(tmp_path) -> Iterator[ServerProcess]:
    process = ServerProcess(tmp_path / "data", inference_threads=1, inference_queue_size=0).start()
    yield process
    process.stop()


def test_inference_pool_full(one_slot_server):
    body = {"inputs": {"x": [[0.25, -0.5, 1, 2]] * 1024}}  # ~0.35 s in onnxruntime on two cores
    with one_slot_server.client() as client:
        assert upload(client, "slow", synthetic.slow_model(), EXACT).status_code == 201
        assert client.post("/models/slow/predict", json=body).status_code == 200

        gate = threading.Barrier(8)
        responses: list[httpx.Response] = []

        def fire() -> None:
            gate.wait()
            responses.append(client.post("/models/slow/predict", json=body))

        threads = [threading.Thread(target=fire) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

        assert len(responses) == 8
        codes = sorted(r.status_code for r in responses)
        assert set(codes) == {200, 503}, codes
        for response in responses:
            if response.status_code == 503:
                assert_error(response, 503, "inference pool is full")
        # The slot frees once the running request is done.
        response = client.post("/models/slow/predict", json=body)
        assert response.status_code == 200, response.text
        assert len(response.json()["outputs"]["y"]) == 1024
    assert one_slot_server.process.poll() is None


def test_a_client_gone_mid_body_is_no_server_error(client, server):
    said = "client disconnected before its request body was read whole"
    for count, (path, head) in enumerate((("/predict", "application/json"), ("/models/gone", "application/x"))):
        method = "POST" if path == "/predict" else "PUT"
        with socket.create_connection(("127.0.0.1", server.port)) as raw:
            request = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {head}\r\nContent-Length: 900\r\n\r\n"
            raw.sendall(request.encode() + b'{"model": "add"')
        wait_until(lambda: server.log().count(said) > count, timeout=30, what=f"{path}'s disconnect logged")  # noqa: B023
    assert client.get("/healthz").status_code == 200
    assert "unhandled error" not in server.log()
    assert client.get("/models/gone").status_code == 404


# -- afterwards ------------------------------------------------------------


def test_server_survives_and_leaves_no_debris(client, server):
    assert server.process.poll() is None
    assert client.get("/healthz").status_code == 200
    response = client.post("/predict", json={"model": "add", "inputs": {"x": [[1, 2, 3, 4]]}})
    assert response.status_code == 200, response.text
    assert response.json()["outputs"] == {"y": [[2, 4, 6, 8]]}

    models = server.data_dir / "models"
    assert list((models / ".staging").iterdir()) == []
    listed = {m["name"]: m["version"] for m in client.get("/models").json()["models"]}
    assert {"add", "add_int", "two"} <= set(listed)
    assert not {"big", "broken", "configured", "warm", "chunked", "a" * 64} & set(listed)
    on_disk = {entry.name for entry in models.iterdir() if not entry.name.startswith(".")}  # the store's own
    assert on_disk == set(listed)
    for name, version in listed.items():
        assert [v.name for v in (models / name).iterdir()] == [f"v{version}"]
        assert sorted(f.name for f in (models / name / f"v{version}").iterdir()) == ["model.onnx", "record.json"]
