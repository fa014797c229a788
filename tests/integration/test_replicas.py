"""Three real jitserve processes on one data directory, as replicas behind a
load balancer share one volume: each kernel is compiled once for all of
them, a model uploaded, replaced or deleted on one is followed by the others
within seconds, and a replica killed mid-compile hands its lease on."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import psutil
import pytest

from compiler.models.demo import demo_model_bytes
from compiler.running.engines import OrtEngine
from compiler.shapes.buckets import bucket_label
from compiler.storage.store import KernelStore
from tests.integration.serverproc import ServerProcess, metric_value, variant, wait_until
from tests.integration.test_crash import compile_children
from tests.integration.test_serving import upload

DEMO = demo_model_bytes()
REFERENCE = OrtEngine(DEMO)
FOLLOW_SECONDS = 5.0
"""The goal: a model changed on one replica serves from every replica within this."""
SIZES = range(1, 17)  # pow2 buckets 1, 2, 4, 8, 16
BUCKETS = {f"x={n}x4" for n in (1, 2, 4, 8, 16)}


def x(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 4)).astype(np.float32)


def predict(client, model: str, data: np.ndarray):
    return client.post("/predict", json={"model": model, "inputs": {"x": data.tolist()}})


def start_replicas(data, count: int = 3, **settings) -> list[ServerProcess]:
    replicas = []
    try:
        for _ in range(count):
            replicas.append(ServerProcess(data, tuning_enabled=False, **settings).start())
    except BaseException:
        for replica in replicas:
            replica.stop()
        raise
    return replicas


@pytest.fixture
def replicas(tmp_path):
    started = start_replicas(tmp_path / "data")
    yield started
    for replica in started:
        replica.stop()


def all_ready(replicas, labels: set[str]) -> bool:
    """Whether every replica has each of ``labels`` of model ``m`` ready."""
    for replica in replicas:
        with replica.client() as client:
            buckets = {b["bucket"]: b["state"] for b in client.get("/models/m").json()["buckets"]}
        if any(buckets.get(label) != "ready" for label in labels):
            return False
    return True


def version_everywhere(replicas, name: str) -> list[int | None]:
    versions = []
    for replica in replicas:
        with replica.client() as client:
            response = client.get(f"/models/{name}")
            versions.append(response.json()["version"] if response.status_code == 200 else None)
    return versions


def follow_seconds(replicas, name: str, version: int | None) -> float:
    """Seconds until every replica serves ``version`` of ``name`` (None: none serves it)."""
    started = time.monotonic()
    wait_until(lambda: version_everywhere(replicas, name) == [version] * len(replicas), timeout=30, interval=0.05)
    return time.monotonic() - started


WARM = {"warm_buckets": [{"x": [8, 4]}]}


def readiness_answers(replicas, stop: threading.Event) -> list[int]:
    """Every replica's /readyz status, polled until ``stop``."""
    answers = []
    clients = [replica.client() for replica in replicas]
    try:
        while not stop.wait(0.05):
            answers.extend(client.get("/readyz").status_code for client in clients)
    finally:
        for client in clients:
            client.close()
    return answers


def test_three_replicas_compile_each_bucket_once_under_churn_and_follow_every_change(replicas, tmp_path):
    first, second, third = replicas
    # An upload with a warm bucket, followed by every replica, takes none out of service meanwhile.
    stop_polling = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        polling = pool.submit(readiness_answers, replicas, stop_polling)
        with first.client() as client:
            assert upload(client, "m", DEMO, WARM).status_code == 201
        seconds = follow_seconds(replicas, "m", 1)
        try:
            wait_until(lambda: all_ready(replicas, {"x=8x4"}), timeout=120, interval=0.1, what="the warm bucket")
        finally:
            stop_polling.set()
        answers = polling.result()
    print(f"\nupload on one replica served by all three after {seconds:.2f} s; /readyz {len(answers)} polls")
    assert seconds < FOLLOW_SECONDS
    assert len(answers) >= 3 and set(answers) == {200}
    for replica in replicas:  # served, and right, by every replica
        with replica.client() as client:
            response = predict(client, "m", x(3))
            assert response.status_code == 200, response.text

    # Shape churn over all three replicas until every bucket is ready on every one.
    errors: list[str] = []
    answered = [0]
    stop = threading.Event()

    def churn(seed: int) -> None:
        rng = random.Random(seed)
        clients = [replica.client() for replica in replicas]
        try:
            while not stop.is_set():
                n = rng.choice(SIZES)
                data = x(n, seed=n)
                response = predict(rng.choice(clients), "m", data)
                if response.status_code != 200:
                    errors.append(f"{response.status_code} {response.text}")
                    continue
                got = np.asarray(response.json()["outputs"]["probs"], dtype=np.float32)
                if not np.allclose(got, REFERENCE.run({"x": data})["probs"], rtol=1e-4, atol=1e-5):
                    errors.append(f"wrong answer for batch {n} from {response.json()['engine']}")
                answered[0] += 1
        finally:
            for client in clients:
                client.close()

    started = time.monotonic()
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(churn, seed) for seed in range(6)]
        try:
            wait_until(
                lambda: all_ready(replicas, BUCKETS),
                timeout=300,
                interval=0.5,
                what="every bucket ready on every replica",
            )
        finally:
            stop.set()
        for future in futures:
            future.result()
    print(f"{answered[0]} requests; every bucket ready on every replica after {time.monotonic() - started:.1f} s")
    assert errors == []

    texts = []
    for replica in replicas:
        with replica.client() as client:
            texts.append(client.get("/metrics").text)
    compiles = [metric_value(text, "jitserve_compiles_total", model="m", tier="tvm", outcome="ok") for text in texts]
    loaded = [metric_value(text, "jitserve_kernel_reloads_total", model="m") for text in texts]
    by_peers = [metric_value(text, "jitserve_kernels_built_by_peers_total") for text in texts]
    print(f"compiles per replica {compiles}, loaded from the store {loaded}, of which waited for a peer {by_peers}")
    assert sum(compiles) == len(BUCKETS)  # once for the fleet, not once per replica
    assert sum(loaded) == len(BUCKETS) * (len(replicas) - 1)  # the others load what one compiled

    store = KernelStore(tmp_path / "data" / "kernels")
    ok, damaged = store.check()
    assert (ok, damaged) == (len(BUCKETS), [])
    assert {bucket_label(manifest.bucket) for manifest in map(store.get, store.keys())} == BUCKETS
    assert list(store.staging_root.iterdir()) == []
    assert list(store.leases.iterdir()) == []  # a lease file goes once its kernel is built

    # Replace on one replica, delete on another: every replica follows.
    with second.client() as client:
        assert upload(client, "m", variant(DEMO, "v2"), replace="true").status_code == 201
    seconds = follow_seconds(replicas, "m", 2)
    print(f"replace followed by all three after {seconds:.2f} s")
    assert seconds < FOLLOW_SECONDS
    with third.client() as client:
        assert client.delete("/models/m").status_code in (200, 204)
    seconds = follow_seconds(replicas, "m", None)
    print(f"delete followed by all three after {seconds:.2f} s")
    assert seconds < FOLLOW_SECONDS
    assert not (tmp_path / "data" / "models" / "m").exists()


def test_uploads_racing_on_different_replicas_take_distinct_versions(replicas):
    """Two replicas replacing one model at once never take one version number; all converge on the last."""
    with replicas[0].client() as client:
        assert upload(client, "r", DEMO).status_code == 201
    follow_seconds(replicas, "r", 1)
    barrier = threading.Barrier(len(replicas))

    def replace(index: int) -> int:
        with replicas[index].client() as client:
            barrier.wait()
            response = upload(client, "r", variant(DEMO, f"race {index}"), replace="true")
            assert response.status_code == 201, response.text
            return response.json()["version"]

    with ThreadPoolExecutor(len(replicas)) as pool:
        versions = sorted(pool.map(replace, range(len(replicas))))
    assert versions == [2, 3, 4]
    follow_seconds(replicas, "r", 4)
    # A fresh name uploaded on two replicas at once: one wins, the other hears 409.
    barrier = threading.Barrier(2)

    def create(index: int) -> int:
        with replicas[index].client() as client:
            barrier.wait()
            return upload(client, "fresh", variant(DEMO, f"fresh {index}")).status_code

    with ThreadPoolExecutor(2) as pool:
        assert sorted(pool.map(create, range(2))) == [201, 409]
    follow_seconds(replicas, "fresh", 1)


def test_a_replica_killed_while_it_holds_a_kernel_lease_hands_it_on(tmp_path):
    data = tmp_path / "data"
    warm = {"axes": {"batch": {"kind": "exact"}}, "warm_buckets": [{"x": [3, 4]}]}
    holder, waiter = start_replicas(data, count=2)
    children = []
    try:
        with holder.client() as client:
            assert upload(client, "w", DEMO, warm).status_code == 201
        children = wait_until(lambda: compile_children(holder.process.pid), timeout=60, interval=0.01)
        for child in children:  # frozen mid-compile, its lease held
            os.kill(child.pid, signal.SIGSTOP)
        follow_seconds([holder, waiter], "w", 1)
        with waiter.client() as client:  # the waiter's warm compile waits on the holder's lease
            wait_until(lambda: bucket_state(client, "w", "x=3x4") == "compiling", timeout=30)
            time.sleep(1.0)
            assert bucket_state(client, "w", "x=3x4") == "compiling"
            assert compile_children(waiter.process.pid) == []
            holder.process.kill()
            holder.process.wait()
            psutil.wait_procs(children, timeout=5)
            wait_until(lambda: bucket_state(client, "w", "x=3x4") == "ready", timeout=120)
            text = client.get("/metrics").text
        assert metric_value(text, "jitserve_compiles_total", model="w", outcome="ok") == 1
        assert metric_value(text, "jitserve_compile_lease_takeovers_total") == 1
        assert "took over" in waiter.log()
    finally:
        for child in children:  # frozen before it could set its parent-death signal: reaped here
            with contextlib.suppress(psutil.Error):
                child.kill()
        holder.stop()
        waiter.stop()
    store = KernelStore(data / "kernels")  # a later start sweeps what the killed replica left
    assert store.check() == (1, [])
    assert list(store.staging_root.iterdir()) == []


def bucket_state(client, model: str, label: str) -> str | None:
    for bucket in client.get(f"/models/{model}").json()["buckets"]:
        if bucket["bucket"] == label:
            return bucket["state"]
    return None
