"""The HTTP layer in-process: the app built by ``create_app`` (real runtime,
fake compiler) driven through httpx's ASGI transport, and what
``/openapi.json`` documents."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np

from compiler.models.demo import DEMO_NAME, demo_model_bytes
from compiler.running.engines import OrtEngine
from server.app import create_app, error_response
from server.runtime.models.records import MODEL_NAME
from server.runtime.observability.metrics import Metrics
from server.runtime.service import ModelService
from server.runtime.wiring import build_runtime
from server.settings import Settings
from tests.server.fakes import FakeCompiler, FakeKernels, wait_until

DEMO = demo_model_bytes()


def build_app(tmp_path, **settings):
    settings = Settings(data_dir=tmp_path, tuning_enabled=False, routing="compiled", routing_runs=2, **settings)
    compiler = FakeCompiler()

    def service_factory(s: Settings, metrics: Metrics) -> ModelService:
        return build_runtime(s, metrics, compile_function=compiler, open_engine=FakeKernels(DEMO))

    return create_app(settings, service_factory=service_factory), compiler


def drive(app, scenario):
    """Run ``scenario(client)`` inside the app's lifespan, over the ASGI transport."""

    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://jitserve") as client:
                return await scenario(client)

    return asyncio.run(main())


def test_demo_predicts_then_moves_to_its_kernel(tmp_path):
    app, compiler = build_app(tmp_path)
    x = [[1.0, 2.0, 3.0, 4.0]]
    want = OrtEngine(DEMO).run({"x": np.asarray(x, dtype=np.float32)})["probs"]

    async def scenario(client: httpx.AsyncClient):
        ready = await client.get("/readyz")
        first = await client.post("/predict", json={"model": DEMO_NAME, "inputs": {"x": x}})
        await asyncio.to_thread(wait_until, lambda: app.state.service.ready()[0])
        second = await client.post(f"/models/{DEMO_NAME}/predict", json={"inputs": {"x": x}})
        described = await client.get(f"/models/{DEMO_NAME}")
        return ready, first, second, described

    ready, first, second, described = drive(app, scenario)
    assert ready.status_code in (200, 503)
    for response in (first, second):
        assert response.status_code == 200
        assert response.headers["server-timing"].startswith("inference;dur=")
        body = response.json()
        assert set(body) == {"model", "version", "outputs", "engine", "bucket"}
        np.testing.assert_allclose(body["outputs"]["probs"], want, rtol=1e-6)
    assert second.json()["engine"] == "tvm"
    assert described.json()["buckets"][0]["state"] == "ready"
    assert compiler.total == 1


def test_errors_are_json_with_their_status(tmp_path):
    app, _ = build_app(tmp_path, admin_token="secret", max_predict_bytes=1000)

    async def scenario(client: httpx.AsyncClient):
        return {
            "unknown model": await client.post("/predict", json={"model": "nope", "inputs": {}}),
            "malformed": await client.post("/predict", content=b"{not json"),
            "missing inputs": await client.post("/predict", json={"model": DEMO_NAME}),
            "bad rank": await client.post("/predict", json={"model": DEMO_NAME, "inputs": {"x": [1, 2, 3, 4]}}),
            "too large": await client.post("/predict", content=b"[" + b"1," * 1000 + b"1]"),
            "no token": await client.put("/models/other", content=DEMO),
            "bad query": await client.put("/models/other?replace=maybe", content=DEMO, headers=AUTH),
            "exists": await client.put(f"/models/{DEMO_NAME}", content=DEMO, headers=AUTH),
            "not onnx": await client.put("/models/other", content=b"garbage", headers=AUTH),
            "delete unknown": await client.delete("/models/nope", headers=AUTH),
        }

    answers = drive(app, scenario)
    codes = {what: response.status_code for what, response in answers.items()}
    assert codes == {
        "unknown model": 404,
        "malformed": 400,
        "missing inputs": 400,
        "bad rank": 400,
        "too large": 413,
        "no token": 401,
        "bad query": 400,
        "exists": 409,
        "not onnx": 422,
        "delete unknown": 404,
    }
    for what, response in answers.items():
        assert set(response.json()) == {"error"}, what
        assert response.json()["error"], what
    counted = app.state.metrics.serving.requests
    assert counted.labels("", "none", "404", "rest")._value.get() == 1
    assert counted.labels(DEMO_NAME, "none", "400", "rest")._value.get() == 2  # missing inputs (named), bad rank
    assert counted.labels("", "none", "413", "rest")._value.get() == 1


AUTH = {"authorization": "Bearer secret"}


def test_openapi_documents_every_request_and_response(tmp_path):
    app, _ = build_app(tmp_path)
    spec = drive(app, lambda client: client.get("/openapi.json")).json()
    operations = {(method, path): op for path, item in spec["paths"].items() for method, op in item.items()}
    assert set(operations) == {
        ("put", "/models/{name}"),
        ("get", "/models"),
        ("get", "/models/{name}"),
        ("delete", "/models/{name}"),
        ("post", "/predict"),
        ("post", "/models/{name}/predict"),
        ("get", "/healthz"),
        ("get", "/readyz"),
        ("get", "/metrics"),
        ("get", "/v2"),
        ("get", "/v2/health/live"),
        ("get", "/v2/health/ready"),
        ("get", "/v2/models/{name}"),
        ("get", "/v2/models/{name}/versions/{version}"),
        ("get", "/v2/models/{name}/ready"),
        ("get", "/v2/models/{name}/versions/{version}/ready"),
        ("post", "/v2/models/{name}/infer"),
        ("post", "/v2/models/{name}/versions/{version}/infer"),
        ("post", "/v2/models/{name}/generate"),
        ("post", "/v2/models/{name}/generate_stream"),
        ("post", "/v2/repository/index"),
        ("post", "/v2/repository/models/{name}/load"),
        ("post", "/v2/repository/models/{name}/unload"),
        ("get", "/server"),
        ("get", "/models/{name}/buckets/{bucket}/explain"),
        ("get", "/models/{name}/buckets/{bucket}/explain.html"),
        ("get", "/models/{name}/buckets/{bucket}/explain/ir/{stage}"),
        ("get", "/models/{name}/buckets/{bucket}/explain/code/{module}"),
        ("get", "/models/{name}/buckets/{bucket}/explain/trace"),
        ("post", "/models/{name}/buckets/{bucket}/explain/profile"),
    }
    for (method, path), op in operations.items():
        success = next(code for code in op["responses"] if code.startswith("2"))
        if success != "204":
            content = op["responses"][success]["content"]
            schema = next(iter(content.values()))["schema"]
            assert schema and schema != {}, (method, path)
        for code, response in op["responses"].items():
            if code.startswith(("4", "5")) and path not in ("/readyz", "/v2/health/ready"):
                assert response["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorBody"}
    schemas = spec["components"]["schemas"]
    assert set(schemas["PredictResponse"]["required"]) == {"model", "version", "outputs", "engine", "bucket"}
    assert "application/json" in operations[("post", "/predict")]["requestBody"]["content"]
    upload = operations[("put", "/models/{name}")]["requestBody"]["content"]
    assert {"application/octet-stream", "multipart/form-data"} <= set(upload)
    assert schemas["Bucket"]["properties"]["state"] == {"$ref": "#/components/schemas/BucketState"}
    infer = operations[("post", "/v2/models/{name}/infer")]["requestBody"]["content"]
    assert {"application/json", "application/octet-stream"} <= set(infer)
    # every reference resolves: the request bodies' own $defs were hoisted into the components
    assert infer["application/json"]["schema"]["properties"]["inputs"]["items"] == {
        "$ref": "#/components/schemas/V2Tensor"
    }
    assert "V2Tensor" in schemas and "$defs" not in json.dumps(spec)

    def body_of(method: str, path: str) -> dict:
        return operations[(method, path)]["requestBody"]["content"]["application/json"]["schema"]

    assert body_of("post", "/predict")["required"] == ["inputs", "model"]
    assert "model" not in body_of("post", "/models/{name}/predict")["properties"]
    # path parameters as constrained as the server constrains them
    for (method, path), op in operations.items():
        for parameter in op.get("parameters", []):
            if parameter["name"] == "name":
                assert parameter["schema"]["pattern"] == MODEL_NAME.pattern, (method, path)
    assert "HTTPValidationError" not in schemas  # validation errors answer 400 {"error"}
    assert schemas["BucketState"]["enum"] == ["cold", "admitted", "compiling", "ready", "failed"]


def test_a_method_a_path_lacks_answers_405_naming_every_method_it_has(tmp_path):
    app, _ = build_app(tmp_path)

    async def scenario(client: httpx.AsyncClient):
        return [await client.request(method, path) for method, path in (
            ("OPTIONS", "/models/demo"), ("TRACE", "/healthz"), ("GET", "/predict"), ("PATCH", "/v2/models/a/infer"),
        )]  # fmt: skip

    answers = drive(app, scenario)
    assert [r.status_code for r in answers] == [405] * 4
    # Starlette alone names only the first route matching the path (PUT for /models/{name})
    assert [r.headers["allow"] for r in answers] == ["DELETE, GET, PUT", "GET", "POST", "POST"]
    assert answers[0].json() == {"error": "Method Not Allowed"}


def test_a_server_bug_answers_500_with_a_request_id_found_in_the_log(caplog):
    response = error_response(KeyError("boom"))
    assert response.status_code == 500
    request_id = response.headers["X-Request-Id"]
    body = json.loads(response.body)
    assert body == {"error": f"internal error: KeyError (request id {request_id})"}
    logged = [r for r in caplog.records if request_id in r.getMessage()]
    assert logged and logged[0].exc_info[0] is KeyError
    assert error_response(KeyError("boom")).headers["X-Request-Id"] != request_id
