"""Engine timing shared by ``bench`` and the server's routing.

Every engine gets the same input; the median of its timed runs is reported.
Runs come in blocks per engine, the engines taking turns block by block, and
the first runs of each block are not timed, so that one engine's thread pool
winding down does not count against the next.
"""

from __future__ import annotations

import statistics
import threading
import time

from ..running.engines import Engine


def _time_once(engine: Engine, inputs) -> float:
    started = time.perf_counter()
    engine.run(inputs)
    return (time.perf_counter() - started) * 1000


def median_latencies_ms(
    engines: dict[str, Engine], inputs, *, warmup: int = 3, runs: int = 20, block: int = 5
) -> dict[str, float]:
    """Median milliseconds per engine; ``warmup`` untimed runs open an engine's first block, one each later block."""
    samples: dict[str, list[float]] = {name: [] for name in engines}
    while any(len(values) < runs for values in samples.values()):
        for name, engine in engines.items():
            for _ in range(1 if samples[name] else warmup):
                engine.run(inputs)
            for _ in range(min(block, runs - len(samples[name]))):
                samples[name].append(_time_once(engine, inputs))
    return {name: statistics.median(values) for name, values in samples.items()}


def requests_per_second(engines: dict[str, Engine], inputs, *, concurrency: int, runs: int = 10) -> dict[str, float]:
    """Throughput of each engine with ``concurrency`` callers at once, each making ``runs`` calls.

    What serving under concurrent load gets: an ONNX Runtime session on one thread runs callers
    side by side, a kernel using every core runs them one at a time.
    """
    result = {}
    for name, engine in engines.items():
        engine.run(inputs)
        start = threading.Barrier(concurrency + 1)

        def caller(engine=engine, start=start) -> None:
            start.wait()
            for _ in range(runs):
                engine.run(inputs)

        callers = [threading.Thread(target=caller, daemon=True) for _ in range(concurrency)]
        for thread in callers:
            thread.start()
        start.wait()
        began = time.perf_counter()
        for thread in callers:
            thread.join()
        result[name] = concurrency * runs / (time.perf_counter() - began)
    return result
