"""kill -9 at the worst moments, then a restart: compile children die with
the server, and nothing it was writing is left behind."""

from __future__ import annotations

import psutil

from compiler.demo import demo_model_bytes
from tests.integration.serverproc import ServerProcess, metric_value, wait_until
from tests.integration.test_serving import settled_bucket, upload

DEMO = demo_model_bytes()
WARM = {"axes": {"batch": {"kind": "exact"}}, "warm_buckets": [{"x": [3, 4]}]}


def compile_children(pid: int) -> list[psutil.Process]:
    found = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if "spawn" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:
            pass
    return found


def test_a_killed_server_takes_its_compile_children_with_it_and_a_restart_sweeps(tmp_path):
    data = tmp_path / "data"
    server = ServerProcess(data, tuning_enabled=False).start()
    with server.client() as client:
        assert upload(client, "m", DEMO, WARM).status_code == 201
    children = wait_until(lambda: compile_children(server.process.pid), timeout=60, interval=0.01)
    staging = data / "kernels" / "staging"
    left = list(staging.iterdir())  # the compile's private build directory
    assert left

    server.process.kill()
    server.process.wait()
    _, alive = psutil.wait_procs(children, timeout=1)
    orphans = [child for child in alive if child.is_running() and child.status() != psutil.STATUS_ZOMBIE]
    assert orphans == [], orphans  # a zombie is dead: only its reaper (the server) is gone

    server.start()
    try:
        assert not [entry for entry in left if entry.exists()]  # the new server's own compile may be there
        with server.client() as client:
            assert settled_bucket(client, "m", "x=3x4")["state"] == "ready"  # compiled again, from scratch
    finally:
        server.stop()


def test_a_compile_child_killed_by_a_signal_is_retried_and_the_bucket_serves(tmp_path):
    server = ServerProcess(tmp_path / "data", tuning_enabled=False, compile_retry_seconds=1).start()
    try:
        with server.client() as client:
            assert upload(client, "m", DEMO, WARM).status_code == 201
            children = wait_until(lambda: compile_children(server.process.pid), timeout=60, interval=0.01)
            for child in children:
                child.kill()
            failed = wait_until(
                lambda: (b := client.get("/models/m").json()["buckets"][0])["state"] == "failed" and b,
                timeout=60,
                interval=0.05,
            )
            assert "killed by SIGKILL; retry 1 of 2 in 1 s" in failed["reason"], failed
            wait_until(lambda: client.get("/models/m").json()["buckets"][0]["state"] == "ready", timeout=180)
            text = client.get("/metrics").text
            assert metric_value(text, "jitserve_compile_retries_total", model="m") == 1
            assert metric_value(text, "jitserve_compiles_total", model="m", outcome="error") == 1
    finally:
        server.stop()


def test_a_restart_checks_the_store_removes_damaged_kernels_and_skips_damaged_models(tmp_path):
    data = tmp_path / "data"
    server = ServerProcess(data, tuning_enabled=False).start()
    try:
        with server.client() as client:
            assert upload(client, "m", DEMO, WARM).status_code == 201
            assert upload(client, "n", DEMO).status_code == 201
            assert settled_bucket(client, "m", "x=3x4")["state"] == "ready"
        server.stop()
        (library,) = (data / "kernels" / "artifacts").glob("*/*/kernel.so")
        library.write_bytes(library.read_bytes()[:100])  # cut short, as by a full disk or a copy gone wrong
        (model,) = (data / "models" / "n").glob("v*/model.onnx")
        model.write_bytes(model.read_bytes()[:-10] + b"0123456789")

        server.start()
        with server.client() as client:
            assert "store check: 0 kernels ok, 1 damaged removed; 1 models served, 1 skipped" in server.log()
            text = client.get("/metrics").text
            assert metric_value(text, "jitserve_store_check_entries", store="kernels", result="damaged") == 1
            assert metric_value(text, "jitserve_store_check_entries", store="models", result="damaged") == 1
            assert client.get("/models/n").status_code == 404
            assert settled_bucket(client, "m", "x=3x4")["state"] == "ready"  # compiled again
            assert not library.exists() or library.stat().st_size > 100
    finally:
        server.stop()
