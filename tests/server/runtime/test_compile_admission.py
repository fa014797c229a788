"""Compile admission in-process, with the fake compiler: the threshold over a
sliding window, the per-model cap with the coldest evicted, the global
budget, storm protection, the queue ordered by traffic, warm buckets exempt;
every decision visible in the description and the metric."""

from __future__ import annotations

import time

import numpy as np
import pytest

from compiler.models.demo import demo_model_bytes
from server.runtime.models.state import BucketState
from tests.server.fakes import FakeCompiler, FakeKernels, make_service, wait_until

DEMO = demo_model_bytes()
EXACT = {"axes": {"batch": {"kind": "exact"}}}  # every batch size is a bucket of its own


def rows(n: int) -> dict:
    return {"x": np.ones((n, 4), dtype=np.float32).tolist()}


def label(n: int) -> str:
    return f"x={n}x4"


def buckets(service) -> dict[str, dict]:
    return {b["bucket"]: b for b in service.describe("m")["buckets"]}


def decisions(service, decision: str, reason: str) -> float:
    value = service.metrics.registry.get_sample_value(
        "jitserve_compile_admissions_total", {"model": "m", "decision": decision, "reason": reason}
    )
    return value or 0.0


def hit(service, n: int, times: int = 1) -> str:
    engine = ""
    for _ in range(times):
        engine = service.predict("m", rows(n)).engine
    return engine


@pytest.fixture
def compiler():
    compiler = FakeCompiler()
    yield compiler
    compiler.gate.set()


@pytest.fixture
def start(tmp_path, compiler):
    services = []

    def start(**settings):
        service = make_service(tmp_path, compiler, FakeKernels(DEMO), routing="compiled", **settings)
        services.append(service)
        service.register("m", DEMO, EXACT)
        return service

    yield start
    for service in services:
        service.close()


def test_a_bucket_is_compiled_once_it_has_enough_hits_within_the_window(start, compiler):
    service = start(compile_min_hits=3, compile_hit_window_seconds=0.5)
    assert hit(service, 1, 2) == "onnxruntime"
    cold = buckets(service)[label(1)]
    assert (cold["state"], cold["hits"]) == ("cold", 2)
    assert cold["reason"] == "cold: fewer than 3 requests within 0.5 s"
    assert decisions(service, "deferred", "below_threshold") == 2
    time.sleep(0.6)  # both hits leave the window
    hit(service, 1, 2)
    assert buckets(service)[label(1)]["state"] == "cold" and compiler.total == 0
    hit(service, 1)
    wait_until(lambda: buckets(service)[label(1)]["state"] == "ready")
    assert decisions(service, "admitted", "threshold") == 1 and compiler.total == 1
    assert hit(service, 1) == "tvm"


def test_the_cap_evicts_the_coldest_compiled_bucket_for_a_hotter_one(start, compiler):
    service = start(compile_min_hits=1, max_compiled_buckets=2)
    hit(service, 1, 5)
    hit(service, 2, 1)
    wait_until(lambda: all(buckets(service)[label(n)]["state"] == "ready" for n in (1, 2)))
    hit(service, 3, 1)  # not twice as busy as bucket 2: refused
    third = buckets(service)[label(3)]
    assert third["state"] == "cold" and third["reason"].startswith("cold: 2 buckets of the model compiled")
    assert decisions(service, "refused", "cap") == 1
    hit(service, 3, 2)  # now thrice as busy as bucket 2: it takes its place
    wait_until(lambda: buckets(service)[label(3)]["state"] == "ready")
    evicted = buckets(service)[label(2)]
    assert (evicted["state"], evicted["engine"]) == ("cold", "onnxruntime")
    assert evicted["reason"] == f"cold: evicted for the hotter bucket {label(3)} (cap 2)"
    assert decisions(service, "evicted", "hotter_bucket") == 1
    assert buckets(service)[label(1)]["state"] == "ready"
    assert service.describe("m")["compile_admission"]["compiled_buckets"] == 2
    assert hit(service, 2) == "onnxruntime"


def test_the_budget_bounds_compiles_per_window_but_not_reloads(start, compiler):
    service = start(compile_min_hits=1, compiles_per_window=2, max_compiled_buckets=2)
    hit(service, 1, 3)
    hit(service, 2, 2)
    wait_until(lambda: compiler.total == 2 and buckets(service)[label(2)]["state"] == "ready")
    hit(service, 3, 5)  # twice as busy as bucket 2, but the budget is spent
    assert buckets(service)[label(3)]["reason"] == "cold: 2 compiles admitted within 60 s"
    assert decisions(service, "refused", "budget") == 5
    assert buckets(service)[label(2)]["state"] == "ready"  # nothing evicted for a refused bucket
    assert service.describe("m")["compile_admission"]["compiles_admitted_in_window"] == 2
    # A bucket whose kernel is stored reloads past the budget: evicted, then hot again.
    service.settings.compiles_per_window = 3
    hit(service, 3)
    wait_until(lambda: buckets(service)[label(3)]["state"] == "ready")
    assert buckets(service)[label(2)]["state"] == "cold"
    assert service.describe("m")["compile_admission"]["compiles_admitted_in_window"] == 3  # spent again
    hit(service, 2, 20)
    wait_until(lambda: buckets(service)[label(2)]["state"] == "ready")
    assert compiler.total == 3


def test_a_shape_storm_stops_admission_and_onnxruntime_serves_it(start, compiler):
    service = start(compile_min_hits=1, storm_new_buckets=3)
    hit(service, 1)
    wait_until(lambda: buckets(service)[label(1)]["state"] == "ready")
    for n in (2, 3, 4, 5, 6):  # the 4th new bucket in the window starts the storm
        assert service.predict("m", rows(n)).outputs["probs"].shape == (n, 3)
    wait_until(lambda: compiler.total == 3)
    states = {n: buckets(service)[label(n)]["state"] for n in range(1, 7)}
    assert [n for n, s in states.items() if s == "cold"] == [4, 5, 6]
    assert buckets(service)[label(5)]["reason"].startswith("cold: shape storm, 5 new buckets within 60 s")
    admission = service.describe("m")["compile_admission"]
    assert (admission["storm"], admission["new_buckets_in_window"]) == (True, 6)
    assert decisions(service, "refused", "storm") == 3
    assert service.metrics.registry.get_sample_value("jitserve_shape_storm", {"model": "m"}) == 1
    assert hit(service, 1) == "tvm"  # a hot bucket compiled before the storm keeps its kernel
    time.sleep(0.1)
    assert compiler.total == 3


def test_the_busiest_queued_bucket_compiles_first(start, compiler):
    service = start(compile_min_hits=1)
    compiler.gate.clear()
    hit(service, 1)  # takes the one worker
    wait_until(lambda: buckets(service)[label(1)]["state"] == "compiling")
    hit(service, 2, 1)
    hit(service, 3, 6)
    hit(service, 4, 3)
    assert {buckets(service)[label(n)]["state"] for n in (2, 3, 4)} == {"admitted"}
    compiler.gate.set()
    wait_until(lambda: compiler.total == 4)
    by_key = {b["bucket"]: service.get("m").buckets[b["bucket"]].key for b in buckets(service).values()}
    order = [next(lbl for lbl, key in by_key.items() if key == k) for k in compiler.calls]
    assert order == [label(1), label(3), label(4), label(2)]


def test_warm_buckets_skip_admission(tmp_path, compiler):
    service = make_service(tmp_path, compiler, FakeKernels(DEMO), compile_min_hits=50, compiles_per_window=1)
    try:
        service.register("m", DEMO, EXACT | {"warm_buckets": [{"x": [1, 4]}, {"x": [2, 4]}]})
        wait_until(lambda: {b["state"] for b in buckets(service).values()} == {"ready"})
        assert compiler.total == 2
        assert service.describe("m")["compile_admission"]["compiled_buckets"] == 0  # warm ones apart
        bucket = service.get("m").buckets[label(2)]
        assert bucket.warm and bucket.state is BucketState.READY
    finally:
        service.close()


def test_the_storm_gauge_falls_when_the_window_passes(start, compiler):
    service = start(compile_min_hits=1, storm_new_buckets=2, compile_hit_window_seconds=0.3)
    for n in (1, 2, 3, 4):
        hit(service, n)
    assert service.describe("m")["compile_admission"]["storm"] is True

    def gauge() -> float | None:
        text = service.metrics.exposition().decode()
        line = next(line for line in text.splitlines() if line.startswith('jitserve_shape_storm{model="m"}'))
        return float(line.split()[-1])

    assert gauge() == 1
    time.sleep(0.4)  # no request since: only the window moved
    assert gauge() == 0


def test_new_sizes_of_a_symbolic_bucket_make_a_storm_that_defers_its_compile(tmp_path, compiler):
    """A width storm lands in one dynamic bucket: its sizes still count as new shapes, so compile
    admission waits for the storm to pass and the storm's requests stay off the established lane."""
    service = make_service(
        tmp_path, compiler, FakeKernels(DEMO), routing="compiled", compile_min_hits=6, storm_new_buckets=3
    )
    try:
        service.register("m", DEMO, {"axes": {"batch": {"kind": "dynamic", "min": 1, "max": 64}}})
        for n in (1, 2, 2, 3, 4, 5, 5):  # five sizes, one bucket
            assert hit(service, n) == "onnxruntime"
        (bucket,) = service.describe("m")["buckets"]
        assert bucket["bucket"] == "x=batch@1..64x4"
        assert bucket["reason"].startswith("cold: shape storm, 5 new buckets within 60 s"), bucket
        admission = service.describe("m")["compile_admission"]
        assert (admission["storm"], admission["new_buckets_in_window"]) == (True, 5)
        served = service.registry.find("m")
        assert not service.compile_admission.established(served, served.all_buckets()[0])
        assert compiler.total == 0
    finally:
        service.close()


def test_a_dynamic_buckets_compile_waits_out_its_settle_time_and_the_storm(tmp_path, compiler):
    """Admitted at its first request, the dynamic bucket's compile is held: first for the settle time (a
    storm shows by then), then for as long as its new sizes keep the model in a storm. Meanwhile its
    requests are not established traffic."""
    service = make_service(
        tmp_path,
        compiler,
        FakeKernels(DEMO),
        routing="compiled",
        compile_min_hits=1,
        storm_new_buckets=3,
        compile_hit_window_seconds=3.0,
    )
    try:
        service.register("m", DEMO, {"axes": {"batch": {"kind": "dynamic", "min": 1, "max": 64}}})
        started = time.monotonic()
        for n in range(1, 9):  # eight sizes of one bucket within a second: a storm
            assert hit(service, n) == "onnxruntime"
        (bucket,) = service.describe("m")["buckets"]
        assert bucket["state"] == "admitted", bucket
        assert service.describe("m")["compile_admission"]["storm"] is True
        served = service.registry.find("m")
        assert not service.compile_admission.established(served, served.all_buckets()[0])
        time.sleep(2.5)  # past the settle time, still within the storm's window
        assert compiler.total == 0
        wait_until(lambda: buckets(service)["x=batch@1..64x4"]["state"] == "ready", timeout=15)
        assert time.monotonic() - started >= 3.0  # not before the storm's window had passed
        assert compiler.total == 1
        assert hit(service, 9) == "tvm"
    finally:
        service.close()
