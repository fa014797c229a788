"""The cold lane in-process: requests to new shapes (buckets that have not
earned a compile) run on threads of Linux's idle scheduling class; warm
buckets and buckets with the hits a compile needs run on the inference
threads; the lane can be turned off."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from compiler.models.demo import demo_model_bytes
from tests.server.fakes import FakeCompiler, FakeKernels, admit, make_service

DEMO = demo_model_bytes()
EXACT = {"axes": {"batch": {"kind": "exact"}}}


class PolicyProbe:
    """The model's real ONNX Runtime session, noting the scheduling policy of each thread that runs it."""

    def __init__(self, ort) -> None:
        self.ort = ort
        self.policies: list[int] = []

    def run(self, inputs):
        self.policies.append(os.sched_getscheduler(0))
        return self.ort.run(inputs)


def run(service, n: int) -> str:
    job = service.inference.prepare(service.get("m"), {"x": np.ones((n, 4), dtype=np.float32).tolist()})
    return asyncio.run(service.inference.run(job)).engine


def cold_lane_count(service) -> float:
    return service.metrics.registry.get_sample_value("jitserve_cold_lane_requests_total", {"model": "m"}) or 0.0


@pytest.fixture
def start(tmp_path):
    services = []

    def start(config: dict, **settings):
        # No compile workers: every bucket stays cold, so only the hit count tells new from established.
        service = make_service(tmp_path, FakeCompiler(), FakeKernels(DEMO), compile_workers=0, **settings)
        services.append(service)
        served = admit(service, "m", DEMO, config)
        served.ort = probe = PolicyProbe(served.ort)
        return service, probe

    yield start
    for service in services:
        service.close()


def test_new_shapes_run_at_idle_priority_until_they_earn_a_compile(start):
    service, probe = start(EXACT, compile_min_hits=3, inline_max_ms=0)
    assert [run(service, 2) for _ in range(4)] == ["onnxruntime"] * 4
    # three hits earn a compile: the fourth request is established traffic
    assert probe.policies == [os.SCHED_IDLE] * 3 + [os.SCHED_OTHER]
    run(service, 5)
    assert probe.policies[-1] == os.SCHED_IDLE
    assert cold_lane_count(service) == 4


def test_warm_buckets_never_take_the_cold_lane(start):
    service, probe = start(EXACT | {"warm_buckets": [{"x": [2, 4]}]}, inline_max_ms=0)
    run(service, 2)
    assert probe.policies == [os.SCHED_OTHER]
    assert cold_lane_count(service) == 0


def test_the_cold_lane_can_be_turned_off(start):
    service, probe = start(EXACT, cold_lane=False, inline_max_ms=0)
    run(service, 3)
    assert probe.policies == [os.SCHED_OTHER]
    assert cold_lane_count(service) == 0
