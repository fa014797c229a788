"""kill -9 at the worst moments, then a restart: compile children die with
the server, and nothing it was writing is left behind."""

from __future__ import annotations

import psutil

from compiler.demo import demo_model_bytes
from tests.integration.serverproc import ServerProcess, wait_until
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
