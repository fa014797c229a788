"""The admin token, over HTTP against a real ``python -m server``.

With ``JITSERVE_ADMIN_TOKEN`` set, ``PUT`` and ``DELETE`` need
``Authorization: Bearer <token>`` while reads and predictions need nothing;
without it they are open, which the server only allows on loopback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from tests import synthetic
from tests.integration.serverproc import REPO, ServerProcess

TOKEN = "s3cret"
GOOD = {"Authorization": f"Bearer {TOKEN}"}
BAD_HEADERS = {
    "none": {},
    "wrong-token": {"Authorization": "Bearer nope"},
    "token-prefix": {"Authorization": f"Bearer {TOKEN[:-1]}"},
    "token-longer": {"Authorization": f"Bearer {TOKEN}x"},
    "no-scheme": {"Authorization": TOKEN},
    "basic-scheme": {"Authorization": f"Basic {TOKEN}"},
    "empty": {"Authorization": ""},
}
X = {"x": [[1, -2, 3, -4]]}


def assert_unauthorized(response: httpx.Response) -> None:
    assert response.status_code == 401, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}, body
    assert "Bearer" in body["error"], body
    assert response.headers["www-authenticate"] == "Bearer"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory) -> Iterator[ServerProcess]:
    process = ServerProcess(tmp_path_factory.mktemp("guarded") / "data", admin_token=TOKEN).start()
    yield process
    process.stop()


@pytest.fixture
def client(guarded: ServerProcess) -> Iterator[httpx.Client]:
    with guarded.client() as client:
        yield client


@pytest.mark.parametrize("headers", BAD_HEADERS.values(), ids=BAD_HEADERS.keys())
def test_upload_needs_the_token(client, headers):
    assert_unauthorized(client.put("/models/m", content=synthetic.add_model(), headers=headers))
    assert client.get("/models/m").status_code == 404


def test_token_guards_uploads_and_deletes_only(client, guarded):
    assert_unauthorized(client.put("/models/m", content=b"not even a model"))
    assert_unauthorized(client.put("/models/bad name!", content=synthetic.add_model()))

    response = client.put("/models/m", content=synthetic.add_model(), headers=GOOD)
    assert response.status_code == 201, response.text
    assert_unauthorized(client.put("/models/m", content=synthetic.relu_model(["batch", 4]), params={"replace": "true"}))
    assert client.get("/models/m").json()["version"] == 1

    # Reads and predictions are open.
    assert client.get("/models").json()["models"][0]["name"] == "m"
    assert client.get("/models/m").status_code == 200
    for response in (
        client.post("/models/m/predict", json={"inputs": X}),
        client.post("/predict", json={"model": "m", "inputs": X}),
    ):
        assert response.status_code == 200, response.text
        assert response.json()["outputs"] == {"y": [[2, -4, 6, -8]]}
    for path in ("/healthz", "/readyz", "/metrics"):
        assert client.get(path).status_code in (200, 503), path  # readyz is 503 while warm buckets compile

    for headers in BAD_HEADERS.values():
        assert_unauthorized(client.delete("/models/m", headers=headers))
    assert client.get("/models/m").status_code == 200
    assert (guarded.data_dir / "models" / "m").is_dir()

    assert client.delete("/models/m", headers={"Authorization": f"bearer {TOKEN}"}).status_code == 204
    assert client.get("/models/m").status_code == 404
    assert client.delete("/models/m", headers=GOOD).status_code == 404


def test_open_without_a_token(tmp_path):
    process = ServerProcess(tmp_path / "data").start()
    try:
        with process.client() as client:
            response = client.put("/models/m", content=synthetic.add_model())
            assert response.status_code == 201, response.text
            # A token sent to a server without one is simply not needed.
            response = client.put("/models/m", content=synthetic.add_model(), params={"replace": "true"}, headers=GOOD)
            assert response.status_code == 201, response.text
            assert client.get("/models/m").json()["version"] == 2
            assert client.post("/models/m/predict", json={"inputs": X}).status_code == 200
            assert client.delete("/models/m").status_code == 204
    finally:
        process.stop()


def server_env(tmp_path, **settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JITSERVE_")}
    env.update({"JITSERVE_DATA_DIR": str(tmp_path / "data"), "JITSERVE_DEMO_MODEL": "false"})
    env.update({f"JITSERVE_{key.upper()}": value for key, value in settings.items()})
    return env


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.1"])
def test_refuses_non_loopback_host_without_token(tmp_path, host):
    result = subprocess.run(
        [sys.executable, "-m", "server"],
        cwd=REPO,
        env=server_env(tmp_path, host=host),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "JITSERVE_ADMIN_TOKEN" in lines[0] and repr(host) in lines[0], lines[0]
    assert not (tmp_path / "data").exists()  # refused before touching the data dir


def test_non_loopback_host_with_token_starts(tmp_path):
    process = ServerProcess(tmp_path / "data", host="0.0.0.0", admin_token=TOKEN).start()
    try:
        assert process.process.poll() is None
        with process.client() as client:
            assert client.get("/healthz").json() == {"status": "ok"}
            assert_unauthorized(client.put("/models/m", content=synthetic.add_model()))
            assert client.put("/models/m", content=synthetic.add_model(), headers=GOOD).status_code == 201
    finally:
        process.stop()
    assert process.process.returncode is not None
