"""Schemathesis over the OpenAPI document of a real server: every check it has (no 5xx, status codes,
content types, response schemas and headers, schema-valid data accepted, invalid data refused,
undeclared methods answered 405 with Allow), on every operation, for a bounded time.

The server serves the demo model from a compiled kernel, so predictions are fuzzed through TVM as well
as ONNX Runtime; uploads, deletes and the V2 routes are fuzzed too (the config beside this file says
which 4xx a model-dependent operation may answer to schema-valid data).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.serverproc import ServerProcess, wait_until

CONFIG = Path(__file__).with_name("schemathesis.toml")
FUZZ_SECONDS = 60
MIN_CASES = 1000


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = ServerProcess(tmp_path_factory.mktemp("fuzz") / "data", demo_model="true").start()
    with process.client() as client:
        wait_until(lambda: client.get("/readyz").status_code == 200, what="the demo's warm kernel")
    yield process
    process.stop()


def test_schemathesis_finds_no_failure(server, tmp_path):
    command = [
        str(Path(sys.executable).with_name("st")),
        "--config-file", str(CONFIG),
        "run", f"{server.url}/openapi.json",
        "--checks", "all",
        "--max-time", str(FUZZ_SECONDS),
        "--seed", "0",
        "--request-timeout", "30",
        "--no-color",
    ]  # fmt: skip
    run = subprocess.run(command, check=False, capture_output=True, text=True, cwd=tmp_path, timeout=FUZZ_SECONDS * 4)
    report = run.stdout + run.stderr
    assert run.returncode == 0, report[-20000:]
    cases = re.search(r"(\d+) generated, (\d+) passed", report)
    assert cases, report[-5000:]
    generated, passed = map(int, cases.groups())
    assert generated == passed >= MIN_CASES, report[-5000:]
    print(f"schemathesis: {generated} cases generated, {passed} passed")  # shown with -s, for the notes
    # alive, and no request ever reached the handler of server bugs
    assert server.process.poll() is None
    assert "unhandled error" not in server.log()
    with server.client() as client:
        assert client.get("/healthz").status_code == 200
