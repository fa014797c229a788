"""kill -9 at the worst moments, then a restart: compile children die with
the server, and nothing it was writing is left behind."""

from __future__ import annotations

import threading
import time

import httpx
import psutil

from compiler.models.demo import demo_model_bytes
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


def descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def survivors(processes: list[psutil.Process], timeout: float = 1.0) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    return [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_a_server_killed_while_tuning_leaves_no_process_and_nothing_damaged(tmp_path):
    data = tmp_path / "data"
    tuning = {"tune_min_hits": 3, "tuning_interval_seconds": 0.5, "tune_trials_per_bucket": 64}
    server = ServerProcess(data, **tuning).start()
    x = [[1.0, 2.0, 3.0, 4.0]] * 3
    with server.client() as client:
        assert upload(client, "m", DEMO, WARM).status_code == 201
        assert settled_bucket(client, "m", "x=3x4")["state"] == "ready"
        for _ in range(5):
            assert client.post("/models/m/predict", json={"inputs": {"x": x}}).status_code == 200
        # the tuning child and whatever MetaSchedule started under it (builders, runners)
        wait_until(lambda: compile_children(server.process.pid), timeout=120, interval=0.05, what="a tuning child")
    processes = descendants(server.process.pid)
    assert processes
    server.process.kill()
    server.process.wait()
    assert survivors(processes) == []

    server.start()
    try:
        assert "store check: 1 kernels ok, 0 damaged removed; 1 models served, 0 skipped" in server.log()
        with server.client() as client:
            assert settled_bucket(client, "m", "x=3x4")["state"] == "ready"
            assert client.post("/models/m/predict", json={"inputs": {"x": x}}).status_code == 200
    finally:
        server.stop()


def churn(url: str, stop: threading.Event) -> None:
    """Upload and delete models until told to stop or the server is gone."""
    with httpx.Client(base_url=url, timeout=5) as client:
        index = 0
        while not stop.is_set():
            try:
                upload(client, f"m{index % 3}", DEMO, {"axes": {"batch": {"kind": "exact"}}}, replace=True)
                client.delete(f"/models/m{(index + 1) % 3}")
            except httpx.HTTPError:
                return
            index += 1


def test_kill_9_at_any_moment_of_uploads_leaves_a_store_that_restarts_clean(tmp_path):
    """Uploads (receive, validate, version, record write, swap) and deletes in a loop; the server is
    killed at a different moment each round. Every model a restart serves answers right; none is half
    there; no upload folder or staging entry is left."""
    data = tmp_path / "data"
    server = ServerProcess(data, compile_workers=0)
    x = [[1.0, 2.0, 3.0, 4.0]]
    want = None
    for round_number, delay in enumerate((0.05, 0.15, 0.3, 0.5, 0.8)):
        server.start()
        stop = threading.Event()

        threads = [threading.Thread(target=churn, args=(server.url, stop)) for _ in range(2)]
        for thread in threads:
            thread.start()
        time.sleep(delay)
        server.process.kill()
        server.process.wait()
        stop.set()
        for thread in threads:
            thread.join(10)

        server.start()
        check = server.log().rsplit("store check:", 1)[1].splitlines()[0]
        assert "0 damaged removed" in check and "0 skipped" in check, check
        assert list((data / "models" / ".staging").iterdir()) == []  # upload folders, half-written versions
        with server.client() as client:
            names = [m["name"] for m in client.get("/models").json()["models"]]
            for name in names:
                answer = client.post(f"/models/{name}/predict", json={"inputs": {"x": x}})
                assert answer.status_code == 200, (round_number, name, answer.text)
                want = want or answer.json()["outputs"]
                assert answer.json()["outputs"] == want
        server.stop()
