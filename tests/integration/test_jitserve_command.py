"""The ``jitserve`` console script: ``serve`` runs the server with settings as flags, the compiler's
commands answer as ``python -m compiler`` does, and a wrong command or setting is one line of error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx

from tests import synthetic
from tests.integration.serverproc import MARK, free_port, stop_process, wait_until

JITSERVE = Path(sys.executable).parent / "jitserve"


def jitserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(JITSERVE), *args], capture_output=True, text=True, check=False, timeout=120)


def test_help_and_an_unknown_command():
    helped = jitserve("--help")
    assert helped.returncode == 0
    for command in ("serve", "inspect", "compile", "bench", "explain"):
        assert f"jitserve {command}" in helped.stdout
    unknown = jitserve("frobnicate")
    assert unknown.returncode == 2 and "unknown command 'frobnicate'" in unknown.stderr
    assert jitserve().returncode == 2


def test_the_compilers_commands(tmp_path):
    model = tmp_path / "two.onnx"
    model.write_bytes(synthetic.two_input_model())
    inspected = jitserve("inspect", str(model))
    assert inspected.returncode == 0, inspected.stderr
    assert [i["name"] for i in json.loads(inspected.stdout)["inputs"]] == ["a", "b"]
    missing = jitserve("inspect", str(tmp_path / "none.onnx"))
    assert missing.returncode == 1 and missing.stderr.startswith("error: cannot read")


def test_serve_takes_its_settings_as_flags(tmp_path):
    port = free_port()
    env = {**os.environ, MARK: "jitserve-command"}
    env.pop("JITSERVE_PORT", None)
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 - lives as long as the process
    process = subprocess.Popen(
        [str(JITSERVE), "serve", "--port", str(port), "--data-dir", str(tmp_path / "data"), "--demo-model", "true"],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            try:
                return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, timeout=60, what="jitserve serve to answer")
        answer = httpx.post(f"{url}/predict", json={"model": "demo", "inputs": {"x": [[1.0, 2.0, 3.0, 4.0]]}})
        assert answer.status_code == 200, answer.text
        assert (tmp_path / "data" / "models").is_dir()  # --data-dir took
    finally:
        stop_process(process)
        log.close()
    wrong = jitserve("serve", "--port", "not-a-port")
    assert wrong.returncode == 2
    assert wrong.stderr.strip().splitlines()[-1].startswith("error: port: "), wrong.stderr
