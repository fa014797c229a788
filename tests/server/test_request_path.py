"""A request enters the runtime once, whatever its protocol: REST ``/predict`` (model in the body or the
URL), the Open Inference Protocol over REST (JSON and binary tensors) and over gRPC each make one call
to the service, ``infer``, and inside it the sequence is the same: read, decode (one model lookup),
plan, run, encode."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np

from compiler.models.demo import DEMO_NAME
from server.grpc_api import messages as pb
from server.grpc_api.servicer import InferenceServicer
from server.runtime.serving.requests import RequestPath
from tests.server.test_app import build_app, drive

X = [[1.0, 2.0, 3.0, 4.0]]
FLAT = [1.0, 2.0, 3.0, 4.0]


class Recorder:
    """The service as the adapters see it: every attribute they touch is recorded, then forwarded."""

    def __init__(self, service) -> None:
        self._service = service
        self.touched: list[str] = []

    def __getattr__(self, name: str):
        self.touched.append(name)
        return getattr(self._service, name)


def _record_runtime(monkeypatch) -> list[str]:
    """The runtime's own steps inside ``infer``, in order."""
    steps: list[str] = []
    original_prepare, original_lookup = RequestPath._prepare, RequestPath.lookup

    def prepare(self, codec, body):
        steps.append("decode+plan")
        return original_prepare(self, codec, body)

    def lookup(self, name, version=None):
        steps.append("lookup")
        return original_lookup(self, name, version)

    monkeypatch.setattr(RequestPath, "_prepare", prepare)
    monkeypatch.setattr(RequestPath, "lookup", lookup)
    return steps


def _v2_binary_body() -> tuple[bytes, dict]:
    tensor = np.asarray(X, np.float32).tobytes()
    header = json.dumps({"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32",
                                     "parameters": {"binary_data_size": len(tensor)}}]}).encode()  # fmt: skip
    return header + tensor, {"Inference-Header-Content-Length": str(len(header))}


def test_each_protocol_makes_one_call_and_the_runtime_one_lookup(tmp_path, monkeypatch):
    app, _ = build_app(tmp_path)
    steps = _record_runtime(monkeypatch)
    binary, binary_headers = _v2_binary_body()
    requests = {
        "REST /predict": lambda c: c.post("/predict", json={"model": DEMO_NAME, "inputs": {"x": X}}),
        "REST /models/{name}/predict": lambda c: c.post(f"/models/{DEMO_NAME}/predict", json={"inputs": {"x": X}}),
        "V2 REST, JSON": lambda c: c.post(
            f"/v2/models/{DEMO_NAME}/infer",
            json={"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": FLAT}]},
        ),
        "V2 REST, binary": lambda c: c.post(
            f"/v2/models/{DEMO_NAME}/infer",
            content=binary,
            headers={**binary_headers, "content-type": "application/octet-stream"},
        ),
    }
    seen = {}

    async def scenario(client: httpx.AsyncClient):
        service = app.state.service
        recorder = app.state.service = Recorder(service)
        for protocol, send in requests.items():
            recorder.touched.clear()
            steps.clear()
            response = await send(client)
            assert response.status_code == 200, (protocol, response.text)
            seen[protocol] = (list(recorder.touched), list(steps))
        servicer = InferenceServicer(recorder, service.metrics, None)
        recorder.touched.clear()
        steps.clear()
        message = pb.ModelInferRequest(model_name=DEMO_NAME)
        tensor = message.inputs.add(name="x", datatype="FP32", shape=[1, 4])
        tensor.contents.fp32_contents.extend(FLAT)
        answer = await servicer.ModelInfer(message, context=None)
        assert [o.name for o in answer.outputs] == ["probs"]
        seen["gRPC ModelInfer"] = (list(recorder.touched), list(steps))
        app.state.service = service

    drive(app, scenario)
    assert set(seen) == {*requests, "gRPC ModelInfer"}
    for protocol, (touched, runtime_steps) in seen.items():
        assert touched == ["infer"], (protocol, touched)
        assert runtime_steps == ["decode+plan", "lookup"], (protocol, runtime_steps)


def test_a_refused_request_is_counted_under_the_model_it_named(tmp_path):
    app, _ = build_app(tmp_path)

    async def scenario(client: httpx.AsyncClient):
        no_inputs = await client.post("/predict", json={"model": DEMO_NAME})
        unknown = await client.post("/v2/models/nope/infer", json={"inputs": []})
        metrics = (await client.get("/metrics")).text
        return no_inputs, unknown, metrics

    no_inputs, unknown, metrics = drive(app, scenario)
    assert no_inputs.status_code == 400 and "missing 'inputs'" in no_inputs.json()["error"]
    assert unknown.status_code == 404
    assert f'model="{DEMO_NAME}"' in metrics and 'code="400"' in metrics


def test_the_runtime_entry_never_imports_the_web_stack():
    import server.runtime.serving.requests as requests_module

    source = open(requests_module.__file__).read()  # noqa: SIM115 - a read
    assert "fastapi" not in source and "starlette" not in source and "grpc" not in source
    assert asyncio.iscoroutinefunction(RequestPath.infer)
