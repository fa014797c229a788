"""The Open Inference Protocol over gRPC against a real server, driven by Triton's ``tritonclient.grpc``
(pinned, unmodified), KServe's ``InferenceGRPCClient`` and raw bytes: metadata, readiness, infer with raw
and typed contents, the repository calls under the admin token, errors as status codes with the REST
side's messages, metrics by protocol, dynamic batching, the drain on SIGTERM and a hand fuzzer."""

from __future__ import annotations

import random
import signal
import socket
import struct
import threading
import time

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from compiler.models.demo import demo_model_bytes
from compiler.running.engines import OrtEngine
from server.grpc_api import messages as pb
from tests import synthetic
from tests.integration.serverproc import ServerProcess, free_port, metric_value, wait_until
from tests.integration.test_serving import upload
from tests.integration.test_v2 import run_kserve_client

DEMO = demo_model_bytes()
TOKEN = "grpc-secret"
INFER = "/inference.GRPCInferenceService/ModelInfer"
EXACT = {"axes": {"batch": {"kind": "exact"}}}
# Only a full batch of 8 goes at once; anything less waits 2 s: eight concurrent calls make one run.
BATCHING = {"dynamic_batching": {"max_batch_size": 8, "max_queue_delay_us": 2_000_000, "preferred_batch_sizes": [8]}}


def grpc_server(path, **settings) -> ServerProcess:
    server = ServerProcess(path, compile_workers=0, grpc_port=free_port(), **settings)
    server.grpc_target = f"127.0.0.1:{server.settings['grpc_port']}"
    return server.start()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = grpc_server(tmp_path_factory.mktemp("grpc") / "data", admin_token=TOKEN)
    admin = {"authorization": f"Bearer {TOKEN}"}
    with server.client(headers=admin) as client:
        assert upload(client, "demo", DEMO).status_code == 201
        assert upload(client, "batched", DEMO, BATCHING).status_code == 201
    yield server
    server.stop()


@pytest.fixture
def client(server):
    client = triton.InferenceServerClient(server.grpc_target)
    yield client
    client.close()


def demo_input(x: np.ndarray) -> triton.InferInput:
    tensor = triton.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return tensor


def status_of(call) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as raised:
        call()
    return raised.value.status(), raised.value.message()


def test_metadata_and_readiness(client):
    assert client.is_server_live() and client.is_server_ready()
    metadata = client.get_server_metadata()
    assert metadata.name == "jitserve" and {"binary_tensor_data", "model_repository"} <= set(metadata.extensions)
    assert client.is_model_ready("demo") and client.is_model_ready("demo", "1")
    model = client.get_model_metadata("demo", as_json=True)
    assert model["versions"] == ["1"] and model["platform"] == "onnx"
    assert model["inputs"] == [{"name": "x", "datatype": "FP32", "shape": ["-1", "4"]}]
    assert model["outputs"] == [{"name": "probs", "datatype": "FP32", "shape": ["-1", "3"]}]
    assert not client.is_model_ready("nope") and not client.is_model_ready("demo", "7")
    code, message = status_of(lambda: client.get_model_metadata("demo", "7"))
    assert code == "StatusCode.NOT_FOUND" and "has no version '7'; it serves version 1" in message


@pytest.mark.parametrize("rows", [1, 3])
def test_infer_raw_contents_answers_as_onnx_runtime_and_rest(client, server, rows):
    x = np.random.default_rng(rows).standard_normal((rows, 4)).astype(np.float32)
    result = client.infer("demo", [demo_input(x)], request_id=f"r{rows}")
    response = result.get_response()
    assert (response.model_name, response.model_version, response.id) == ("demo", "1", f"r{rows}")
    assert len(response.raw_output_contents) == 1  # raw in, raw out
    want = OrtEngine(DEMO).run({"x": x})["probs"]
    np.testing.assert_allclose(result.as_numpy("probs"), want, rtol=1e-6)
    rest = httpx.post(f"{server.url}/models/demo/predict", json={"inputs": {"x": x.tolist()}}).json()
    np.testing.assert_array_equal(result.as_numpy("probs"), np.asarray(rest["outputs"]["probs"], np.float32))


def test_infer_typed_contents_answers_typed(server):
    """tritonclient always sends raw contents: its own generated stub sends typed ones."""
    x = np.random.default_rng(7).standard_normal((2, 4)).astype(np.float32)
    request = service_pb2.ModelInferRequest(model_name="demo", id="typed")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[2, 4])
    tensor.contents.fp32_contents.extend(x.ravel().tolist())
    with grpc.insecure_channel(server.grpc_target) as channel:
        response = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
    assert not response.raw_output_contents and response.id == "typed"
    (output,) = response.outputs
    assert (output.name, output.datatype, list(output.shape)) == ("probs", "FP32", [2, 3])
    want = OrtEngine(DEMO).run({"x": x})["probs"]
    np.testing.assert_allclose(np.asarray(output.contents.fp32_contents).reshape(2, 3), want, rtol=1e-6)


def test_eight_640x640_rgb_images_in_one_call(client, server):
    with server.client(headers={"authorization": f"Bearer {TOKEN}"}) as http:
        model = synthetic.relu_model(["batch", 3, 640, 640])
        assert upload(http, "relu640", model, {"probe_sizes": {"batch": 2}}).status_code == 201
    x = np.random.default_rng(8).standard_normal((8, 3, 640, 640)).astype(np.float32)  # 39.3 MB
    tensor = triton.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    result = client.infer("relu640", [tensor], outputs=[triton.InferRequestedOutput("y")])
    np.testing.assert_array_equal(result.as_numpy("y"), np.maximum(x, 0))


def rest_error(server, body: dict) -> str:
    answer = httpx.post(f"{server.url}/v2/models/demo/infer", json=body)
    assert answer.status_code == 400
    return answer.json()["error"]


def test_errors_are_status_codes_with_the_rest_sides_messages(client, server):
    x = np.ones((1, 4), np.float32)
    assert status_of(lambda: client.infer("nope", [demo_input(x)])) == (
        "StatusCode.NOT_FOUND",
        "model 'nope' not found",
    )
    wide = triton.InferInput("x", [1, 4], "FP64")
    wide.set_data_from_numpy(x.astype(np.float64))
    code, message = status_of(lambda: client.infer("demo", [wide]))
    rest = rest_error(server, {"inputs": [{"name": "x", "datatype": "FP64", "shape": [1, 4], "data": [1] * 4}]})
    assert (code, message) == ("StatusCode.INVALID_ARGUMENT", rest)
    flat = triton.InferInput("x", [4], "FP32")
    flat.set_data_from_numpy(x.ravel())
    code, message = status_of(lambda: client.infer("demo", [flat]))
    rest = rest_error(server, {"inputs": [{"name": "x", "datatype": "FP32", "shape": [4], "data": [1] * 4}]})
    assert (code, message) == ("StatusCode.INVALID_ARGUMENT", rest)
    assert "rank 1" in message
    code, message = status_of(lambda: client.infer("demo", [demo_input(x)], outputs=[triton.InferRequestedOutput("z")]))
    assert code == "StatusCode.INVALID_ARGUMENT" and "must name one of the model's outputs ['probs']" in message


def test_repository_calls_need_the_admin_token(client, server):
    assert status_of(client.get_model_repository_index)[0] == "StatusCode.UNAUTHENTICATED"
    assert status_of(lambda: client.unload_model("demo"))[0] == "StatusCode.UNAUTHENTICATED"
    assert status_of(lambda: client.unload_model("demo", headers={"authorization": "Bearer wrong"}))[0] == (
        "StatusCode.UNAUTHENTICATED"
    )
    admin = {"authorization": f"Bearer {TOKEN}"}
    index = client.get_model_repository_index(headers=admin, as_json=True)["models"]
    assert {"name": "demo", "version": "1", "state": "READY"} in index
    client.unload_model("demo", headers=admin)
    try:
        assert not client.is_model_ready("demo")
        index = client.get_model_repository_index(headers=admin, as_json=True)["models"]
        assert {"name": "demo", "state": "UNAVAILABLE", "reason": "unloaded"} in index
        with grpc.insecure_channel(server.grpc_target) as channel:
            ready_only = service_pb2_grpc.GRPCInferenceServiceStub(channel).RepositoryIndex(
                service_pb2.RepositoryIndexRequest(ready=True), metadata=[("authorization", f"Bearer {TOKEN}")]
            )
        assert "demo" not in {m.name for m in ready_only.models} and "batched" in {m.name for m in ready_only.models}
    finally:
        client.load_model("demo", headers=admin)
    assert client.is_model_ready("demo")
    assert status_of(lambda: client.load_model("nope", headers=admin))[0] == "StatusCode.NOT_FOUND"


def test_dynamic_batching_joins_concurrent_calls(server):
    with triton.InferenceServerClient(server.grpc_target) as first:  # the bucket seen once already
        first.infer("batched", [demo_input(np.ones((1, 4), np.float32))])
    before = metric_value(httpx.get(f"{server.url}/metrics").text, "jitserve_batch_size_count", model="batched")
    rows = [np.random.default_rng(i).standard_normal((1, 4)).astype(np.float32) for i in range(8)]
    answers: dict[int, np.ndarray] = {}
    clients = [triton.InferenceServerClient(server.grpc_target) for _ in rows]
    assert all(own.is_server_live() for own in clients)  # connected before the calls start together
    start = threading.Barrier(len(rows))

    def call(index: int) -> None:
        start.wait()
        answers[index] = clients[index].infer("batched", [demo_input(rows[index])]).as_numpy("probs")

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for own in clients:
        own.close()
    want = OrtEngine(DEMO).run({"x": np.concatenate(rows)})["probs"]
    np.testing.assert_allclose(np.concatenate([answers[i] for i in range(8)]), want, rtol=1e-5)
    runs = metric_value(httpx.get(f"{server.url}/metrics").text, "jitserve_batch_size_count", model="batched")
    assert runs - before == 1, "eight concurrent calls ran as one batch"


def test_metrics_count_grpc_calls_by_protocol_and_status(client, server):
    text = httpx.get(f"{server.url}/metrics").text
    before = metric_value(text, "jitserve_requests_total", model="demo", code="200", protocol="grpc")
    rest_before = metric_value(text, "jitserve_requests_total", model="demo", code="200", protocol="rest")
    client.infer("demo", [demo_input(np.ones((1, 4), np.float32))])
    wide = triton.InferInput("x", [1, 4], "FP64")
    wide.set_data_from_numpy(np.ones((1, 4)))
    status_of(lambda: client.infer("demo", [wide]))
    text = httpx.get(f"{server.url}/metrics").text
    assert metric_value(text, "jitserve_requests_total", model="demo", code="200", protocol="grpc") == before + 1
    assert metric_value(text, "jitserve_requests_total", model="demo", code="200", protocol="rest") == rest_before
    assert metric_value(text, "jitserve_requests_total", model="demo", code="400", protocol="grpc") >= 1
    assert metric_value(text, "jitserve_grpc_calls_total", method="ModelInfer", code="INVALID_ARGUMENT") >= 1
    assert metric_value(text, "jitserve_grpc_calls_total", method="ModelInfer", code="OK") >= 1
    assert metric_value(text, "jitserve_request_duration_seconds_count", model="demo", protocol="grpc") >= 1


def test_message_limit_is_the_infer_limit(tmp_path):
    small = grpc_server(tmp_path / "data", max_infer_bytes=4096)
    try:
        with small.client() as http:
            assert upload(http, "demo", DEMO).status_code == 201
        with triton.InferenceServerClient(small.grpc_target) as client:
            client.infer("demo", [demo_input(np.ones((64, 4), np.float32))])  # 1 kB: fits
            code, message = status_of(lambda: client.infer("demo", [demo_input(np.ones((512, 4), np.float32))]))
            assert code == "StatusCode.RESOURCE_EXHAUSTED" and "4096" in message
            assert client.is_server_live()
    finally:
        small.stop()


def test_sigterm_lets_a_call_in_flight_finish_and_refuses_new_ones(tmp_path):
    server = grpc_server(tmp_path / "data", shutdown_grace_seconds=30)
    with server.client() as http:
        assert upload(http, "slow", synthetic.slow_model(), EXACT).status_code == 201
    x = np.full((4096, 4), 0.5, dtype=np.float32)  # ~1.4 s of ONNX Runtime on two cores
    answers: list = []

    def slow_call() -> None:
        with triton.InferenceServerClient(server.grpc_target) as own:
            answers.append(own.infer("slow", [demo_input(x)]).as_numpy("y"))

    with triton.InferenceServerClient(server.grpc_target) as client:
        client.infer("slow", [demo_input(x[:1])])
        in_flight = threading.Thread(target=slow_call)
        in_flight.start()
        time.sleep(0.5)
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        code, _ = status_of(lambda: client.infer("slow", [demo_input(x[:1])], client_timeout=10))
        assert code in ("StatusCode.UNAVAILABLE", "StatusCode.CANCELLED")
        in_flight.join(60)
    assert answers and answers[0].shape == (4096, 4), answers
    assert server.process.wait(30) in (0, -signal.SIGTERM)
    assert "Application shutdown complete" in server.log()


# -- the hand fuzzer's gRPC part: raw bytes on the wire, so that nothing client-side filters them


TYPED_VALUES = [
    ("fp32_contents", 1.5),
    ("fp64_contents", 1e308),
    ("int_contents", 2**31 - 1),
    ("int64_contents", -(2**63)),
    ("bool_contents", True),
]


def fuzz_messages(rng: random.Random, count: int) -> list[bytes]:
    x = np.ones((2, 4), np.float32)
    valid = pb.ModelInferRequest(
        model_name="demo",
        inputs=[pb.ModelInferRequest.InferInputTensor(name="x", datatype="FP32", shape=[2, 4])],
        raw_input_contents=[x.tobytes()],
    ).SerializeToString()
    datatypes = ["FP32", "FP16", "FP64", "INT8", "INT64", "UINT64", "BOOL", "BYTES", "", "fp32", "\u0000", "💥"]
    shapes = [[], [0], [0, 4], [-1, 4], [2**62, 4], [2**31, 2**31], [1] * 64, [2, 4], [8], [1, 4, 1], [2**63 - 1]]
    messages = []
    for index in range(count):
        kind = index % 4
        if kind == 0:  # mutated bytes of a valid message: flips, cuts, garbage
            data = bytearray(valid)
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            messages.append(bytes(data[: rng.randint(0, len(data))]) if rng.random() < 0.3 else bytes(data))
        elif kind == 1:  # well-formed protobuf, odd tensors
            shape = rng.choice(shapes)
            tensor = pb.ModelInferRequest.InferInputTensor(name=rng.choice(["x", "y", "", "x" * 300]),
                                                           datatype=rng.choice(datatypes), shape=shape)  # fmt: skip
            request = pb.ModelInferRequest(model_name=rng.choice(["demo", "demo", "nope", ""]), inputs=[tensor])
            request.model_version = rng.choice(["", "", "1", "2", "-1"])
            if rng.random() < 0.5:
                request.raw_input_contents.append(rng.randbytes(rng.choice([0, 4, 31, 32, 33, 4096])))
            else:
                field, value = rng.choice(TYPED_VALUES)
                getattr(tensor.contents, field).extend([value] * rng.choice([0, 1, 8, 9]))
            if rng.random() < 0.2:
                request.outputs.add(name=rng.choice(["probs", "nope"]))
            messages.append(request.SerializeToString())
        elif kind == 2:  # two inputs, or raw beside typed, or raw entries that do not match
            request = pb.ModelInferRequest.FromString(valid)
            choice = rng.randrange(3)
            if choice == 0:
                request.inputs.add(name="x", datatype="FP32", shape=[2, 4])
            elif choice == 1:
                request.inputs[0].contents.fp32_contents.extend([1.0] * 8)
            else:
                request.raw_input_contents.append(b"\0" * 32)
            messages.append(request.SerializeToString())
        else:  # random bytes
            messages.append(rng.randbytes(rng.randint(0, 512)))
    return messages


ACCEPTED_CODES = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def test_hand_fuzzer_gets_no_internal_error_and_the_server_lives(client, server):
    codes: dict[grpc.StatusCode, int] = {}
    with grpc.insecure_channel(server.grpc_target, options=[("grpc.max_send_message_length", -1)]) as channel:
        infer = channel.unary_unary(INFER)  # bytes in, bytes out
        cases = fuzz_messages(random.Random(30), 600)
        cases.append(struct.pack("<I", 7) * (70 * 1024 * 1024 // 4))  # 70 MB: past the 64 MiB message limit
        for data in cases:
            try:
                infer(data, timeout=60)
                code = grpc.StatusCode.OK
            except grpc.RpcError as error:
                code = error.code()
                assert code in ACCEPTED_CODES, f"{code} {error.details()} for {data[:80]!r}"
            codes[code] = codes.get(code, 0) + 1
    assert codes.get(grpc.StatusCode.INVALID_ARGUMENT, 0) > 300 and codes.get(grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert client.is_server_live() and client.is_server_ready()
    x = np.ones((1, 4), np.float32)
    answer = client.infer("demo", [demo_input(x)]).as_numpy("probs")
    np.testing.assert_allclose(answer, OrtEngine(DEMO).run({"x": x})["probs"], rtol=1e-6)
    assert wait_until(lambda: httpx.get(f"{server.url}/healthz").status_code == 200, timeout=10)


def test_a_grpc_port_in_use_stops_the_start_saying_so(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = ServerProcess(tmp_path / "data", compile_workers=0, grpc_port=port)
        with pytest.raises(RuntimeError, match="server exited"):
            server.start(timeout=60)
    assert f"gRPC cannot listen on 127.0.0.1:{port}" in server.log()


def test_kserve_grpc_client_typed_and_raw(server):
    found = run_kserve_client("kserve_grpc_client.py", server.grpc_target, "demo")
    assert (found["live"], found["ready"], found["model_ready"]) == (True, True, True)
    want = OrtEngine(DEMO).run({"x": np.asarray(found["input"], np.float32)})["probs"]
    for kind in ("typed", "raw"):
        assert (found[kind]["id"], found[kind]["model_name"]) == (f"kserve-grpc-{kind == 'raw'}", "demo")
        np.testing.assert_allclose(found[kind]["probs"], want, rtol=1e-6)


def test_a_full_inference_pool_answers_unavailable(tmp_path):
    server = grpc_server(tmp_path / "data", inference_threads=1, inference_queue_size=0)
    try:
        with server.client() as http:
            assert upload(http, "slow", synthetic.slow_model(), EXACT).status_code == 201
        x = np.full((1024, 4), 0.25, dtype=np.float32)  # ~0.35 s of ONNX Runtime on two cores
        clients = [triton.InferenceServerClient(server.grpc_target) for _ in range(8)]
        clients[0].infer("slow", [demo_input(x)])
        gate = threading.Barrier(len(clients))
        outcomes: list[tuple[str, str]] = []

        def fire(own: triton.InferenceServerClient) -> None:
            gate.wait()
            try:
                own.infer("slow", [demo_input(x)])
                outcomes.append(("OK", ""))
            except InferenceServerException as error:
                outcomes.append((error.status(), error.message()))

        threads = [threading.Thread(target=fire, args=(own,)) for own in clients]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert {code for code, _ in outcomes} == {"OK", "StatusCode.UNAVAILABLE"}, outcomes
        assert all(message == "inference pool is full; retry later" for code, message in outcomes if code != "OK")
        assert clients[0].infer("slow", [demo_input(x)]).as_numpy("y").shape == (1024, 4)  # the slot frees
        for own in clients:
            own.close()
    finally:
        server.stop()
