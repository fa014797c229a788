"""The inference threads' fair queue, on real threads: a quiet model's run waits for one run of a stormed
model per thread, not for the storm's queue; weights share the threads; a model's cap leaves threads free."""

from __future__ import annotations

import threading
import time
import weakref

import pytest

from server.runtime.serving.fair_pool import SHARED, SHARING_SECONDS, FairPool


class Gate:
    """Runs that block until released, recording the order they started in."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.running = 0
        self.most_running: dict[str, int] = {}
        self._running_by: dict[str, int] = {}

    def run(self, label: str, model: str, seconds: float = 0.0) -> str:
        with self.lock:
            self.started.append(label)
            self._running_by[model] = self._running_by.get(model, 0) + 1
            self.most_running[model] = max(self.most_running.get(model, 0), self._running_by[model])
        self.release.wait(10)
        time.sleep(seconds)
        with self.lock:
            self._running_by[model] -= 1
        return label


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_a_quiet_models_run_waits_for_one_storm_run_per_thread_not_for_the_storms_queue():
    pool = FairPool(1, "test")
    gate = Gate()
    storm = [pool.submit_as("storm", gate.run, f"storm-{i}", "storm") for i in range(20)]
    wait_until(lambda: gate.started == ["storm-0"])  # the thread is busy; 19 storm runs queue behind it
    quiet = pool.submit_as("quiet", gate.run, "quiet", "quiet")
    gate.release.set()
    assert quiet.result(10) == "quiet"
    for future in storm:
        future.result(10)
    # A first-come-first-served pool would start the quiet run 21st.
    assert gate.started.index("quiet") <= 2, gate.started
    pool.shutdown()


def test_weights_share_the_threads_between_busy_models():
    weights = {"heavy": 3.0, "light": 1.0}
    pool = FairPool(1, "test", weight_of=weights.__getitem__)
    gate = Gate()
    blocker = pool.submit_as("blocker", gate.run, "blocker", "blocker")
    wait_until(lambda: gate.started == ["blocker"])
    futures = [pool.submit_as(model, gate.run, model, model) for _ in range(30) for model in weights]
    gate.release.set()
    for future in [blocker, *futures]:
        future.result(10)
    first = gate.started[1:21]
    assert abs(first.count("heavy") - 15) <= 1, first  # 3 heavy runs for each light one
    pool.shutdown()


def test_a_models_cap_leaves_threads_to_the_others():
    pool = FairPool(2, "test", max_threads_per_model=1)
    gate = Gate()
    storm = [pool.submit_as("storm", gate.run, "storm", "storm", 0.01) for _ in range(6)]
    wait_until(lambda: gate.started == ["storm"])
    time.sleep(0.05)
    assert gate.started == ["storm"]  # the second thread stays free: the storm holds its one
    quiet = pool.submit_as("quiet", gate.run, "quiet", "quiet")
    wait_until(lambda: "quiet" in gate.started)
    gate.release.set()
    quiet.result(10)
    for future in storm:
        future.result(10)
    assert gate.most_running["storm"] == 1
    pool.shutdown()


def test_a_model_alone_holds_every_thread_and_beside_another_all_but_one():
    pool = FairPool(2, "test")
    gate = Gate()
    alone = [pool.submit_as("storm", gate.run, "storm", "storm") for _ in range(2)]
    wait_until(lambda: gate.most_running.get("storm") == 2)  # alone: both threads
    gate.release.set()
    for future in alone:
        future.result(10)
    assert pool.submit_as("quiet", lambda: "quiet").result(10) == "quiet"  # another model asked lately
    gate = Gate()
    storm = [pool.submit_as("storm", gate.run, "storm", "storm") for _ in range(4)]
    time.sleep(0.2)
    assert gate.most_running["storm"] == 1  # the other thread is kept free for the quiet model
    wait_until(lambda: gate.most_running["storm"] == 2, timeout=SHARING_SECONDS + 3)  # quiet long enough: lifted
    gate.release.set()
    for future in storm:
        future.result(10)
    pool.shutdown()


def test_queue_waits_are_reported_per_model_and_errors_reach_the_caller():
    waits: list[tuple[str, float]] = []
    pool = FairPool(1, "test", on_start=lambda key, seconds: waits.append((key, seconds)))
    gate = Gate()
    first = pool.submit_as("a", gate.run, "a", "a")
    wait_until(lambda: gate.started == ["a"])
    second = pool.submit(gate.run, "b", "b")
    time.sleep(0.05)
    gate.release.set()
    first.result(10), second.result(10)
    assert [key for key, _ in waits] == ["a", SHARED]
    assert waits[1][1] >= 0.04  # it waited behind the first run

    def fail():
        raise ValueError("the caller's error")

    with pytest.raises(ValueError, match="the caller's error"):
        pool.submit_as("a", fail).result(10)
    pool.shutdown()


def test_shutdown_cancels_what_waits_and_refuses_new_work():
    pool = FairPool(1, "test")
    gate = Gate()
    running = pool.submit_as("a", gate.run, "a", "a")
    wait_until(lambda: gate.started == ["a"])
    waiting = pool.submit_as("a", gate.run, "a2", "a")
    pool.shutdown(wait=False, cancel_futures=True)
    assert waiting.cancelled()
    with pytest.raises(RuntimeError):
        pool.submit_as("a", gate.run, "a3", "a")
    gate.release.set()
    assert running.result(10) == "a"


def test_threads_start_as_work_comes_and_an_idle_one_keeps_nothing_of_its_last_run():
    """An unused pool (the cold lane of a warm server) holds no threads, and a thread waiting for work holds
    no reference to its last request: that would keep a deleted model's engine, and its weights, alive."""

    class Engine:
        pass

    pool = FairPool(2, "test")
    try:
        assert not [t for t in threading.enumerate() if t.name.startswith("test_")]
        engine = Engine()
        gone = weakref.ref(engine)
        assert pool.submit_as("m", lambda held: type(held).__name__, engine).result(5) == "Engine"
        assert [t.name for t in threading.enumerate() if t.name.startswith("test_")] == ["test_0"]
        del engine
        wait_until(lambda: gone() is None, timeout=2)
    finally:
        pool.shutdown()
