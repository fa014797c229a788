"""The per-process thread plan: TVM's pools get the cores ONNX Runtime gets."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from compiler.building.target import host_cores
from compiler.measuring.timing import median_latencies_ms

_PROBE = """
import json, sys
from compiler.building.threads import apply_thread_plan
planned = apply_thread_plan(int(sys.argv[1]))
import tvm
print(json.dumps({"planned": planned, "tvm": tvm.get_global_func("runtime.NumThreads")()}))
"""


def _threads_in_fresh_process(kernel_threads: int) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, str(kernel_threads)], capture_output=True, text=True, check=True, timeout=120
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_tvm_pool_uses_every_usable_core_by_default():
    # Without the plan TVM sizes its pool to half the hardware threads (1 on 2 cores).
    assert _threads_in_fresh_process(0) == {"planned": host_cores(), "tvm": host_cores()}


def test_kernel_threads_setting_sizes_the_pool():
    # TVM caps its pool at the hardware threads, so ask for fewer than the default.
    assert _threads_in_fresh_process(1) == {"planned": 1, "tvm": 1}


class _CountingEngine:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def run(self, inputs):
        self.log.append(self.name)
        return {"y": np.zeros(1)}


def test_latencies_are_timed_in_blocks_each_opened_by_untimed_runs():
    calls: list[str] = []
    engines = {name: _CountingEngine(name, calls) for name in ("a", "b")}
    latency = median_latencies_ms(engines, {}, warmup=2, runs=7, block=3)
    assert set(latency) == {"a", "b"} and all(ms >= 0 for ms in latency.values())
    # a: 2 warm-up + 3 timed, b: the same, then blocks of 1 untimed + 3, then 1 + 1.
    blocks = ["a"] * 5 + ["b"] * 5 + ["a"] * 4 + ["b"] * 4 + ["a"] * 2 + ["b"] * 2
    assert calls == blocks
