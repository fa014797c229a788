"""Fakes for in-process runtime tests: a compiler that writes real artifacts
into the real store without TVM (and can be held at a gate), and kernels
that compute with ONNX Runtime at a chosen extra latency."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import Counter
from functools import partial
from pathlib import Path

import numpy as np
import onnx

from compiler.building.build import CompileOutcome, bucket_key
from compiler.models.model import load_model
from compiler.models.weights import save_prepared
from compiler.running.engines import Engine, OrtEngine
from compiler.storage.store import LIBRARY_NAME, KernelStore, Manifest
from compiler.tvm import COMPILER_VERSION
from server.runtime.observability.metrics import Metrics
from server.runtime.service import ModelService
from server.runtime.wiring import build_runtime
from server.settings import Settings
from tests.integration.serverproc import wait_until as wait_until_slow

# In-process waits are short and poll often.
wait_until = partial(wait_until_slow, timeout=20, interval=0.01)


class FakeCompiler:
    """Stands in for ``compile_bucket``: counts compiles per key, blocks while the gate is closed."""

    def __init__(self, *, verified: bool = True, errors: list[Exception] | None = None) -> None:
        """``errors`` are raised by the first compiles, one each (as a compile child's failure would be)."""
        self.verified = verified
        self.errors = list(errors or [])
        self.calls: Counter[str] = Counter()
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()

    def __call__(
        self,
        model,
        bucket,
        target,
        store: KernelStore,
        options,
        *,
        progress_path=None,
        verify_sizes=None,
        kernel_times=None,
    ) -> CompileOutcome:
        key = bucket_key(model.graph_digest, bucket, target=target, options=options, verify_sizes=verify_sizes)
        existing = store.get(key)
        if existing is not None:
            return CompileOutcome(existing, True, str(store.library_path(key)))
        if not store.has_prepared(model.digest):  # the version's weights, as compile_bucket prepares them
            with store.staging("prepare") as staging:
                save_prepared(staging, onnx.ModelProto(), {})
                store.commit_prepared(staging, model.digest)
        self.calls[key] += 1
        if self.errors:
            raise self.errors.pop(0)
        if progress_path and options.tune_trials:  # as the tuning child reports while it runs
            Path(progress_path).write_text(json.dumps({"trials": options.tune_trials - 1, "best_ms": 0.25}))
        self.started.set()
        assert self.gate.wait(30), "the test never opened the compile gate"
        with store.staging(key) as staging:
            (staging / LIBRARY_NAME).write_bytes(b"not a real library")
            manifest = Manifest(
                key=key,
                graph_digest=model.graph_digest,
                bucket={k: list(v) for k, v in bucket.items()},
                target=target,
                tvm_version=f"fake-{COMPILER_VERSION}",
                options=options.key_options(),
                compile_seconds=0.01,
                simplified=True,
                verified=self.verified,
                verification="ok" if self.verified else "output 'probs' differs by up to 1",
                max_abs_error=0.0,
                rtol=options.rtol,
                atol=options.atol,
                library_bytes=18,
                created_at=time.time(),
                tuning={"trials": options.tune_trials, "tasks": 1, "tune_seconds": 0.01}
                if options.tune_trials
                else None,
            )
            manifest = store.commit(staging, manifest)
        return CompileOutcome(manifest, False, str(store.library_path(key)))

    @property
    def total(self) -> int:
        return sum(self.calls.values())


class SlowEngine:
    """Any engine plus a fixed delay per call; ``hold`` blocks calls until released. Calls holding ``turns``
    for their delay take turns, as kernels that each use every core do; others overlap, as ONNX Runtime
    sessions on one thread each do."""

    name = "slow"

    def __init__(self, inner: Engine, delay: float = 0.0, turns: threading.Lock | None = None) -> None:
        self.inner = inner
        self.delay = delay
        self.turns = turns or contextlib.nullcontext()
        self.hold = threading.Event()
        self.hold.set()
        self.entered = threading.Event()
        self.shapes: list[dict[str, tuple[int, ...]]] = []

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.shapes.append({name: array.shape for name, array in inputs.items()})
        self.entered.set()
        assert self.hold.wait(30), "the test never released the engine"
        if self.delay:
            with self.turns:
                time.sleep(self.delay)
        return self.inner.run(inputs)


class FakeKernels:
    """``open_engine`` for the runtime: a "kernel" computing with ONNX Runtime on the model's bytes."""

    def __init__(self, model_bytes: bytes, delay: float = 0.0, *, every_core: bool = False) -> None:
        """``every_core``: the kernels' delays take turns (all instances': they share the cores)."""
        self.model_bytes = model_bytes
        self.delay = delay
        self.turns = threading.Lock() if every_core else None
        self.opened: list[SlowEngine] = []

    def __call__(self, library: Path, signature, target, weights) -> Engine:
        assert Path(library).is_file()
        engine = SlowEngine(OrtEngine(self.model_bytes, spinning=False), self.delay, self.turns)
        self.opened.append(engine)
        return engine


def make_service(data_dir: Path, compiler: FakeCompiler, kernels: FakeKernels, **settings) -> ModelService:
    defaults = {"demo_model": False, "tuning_enabled": False, "routing_runs": 3, "compile_min_hits": 1}
    service = build_runtime(
        Settings(data_dir=data_dir, **(defaults | settings)),
        Metrics(),
        compile_function=compiler,
        open_engine=kernels,
    )
    service.start()
    return service


def admit(service: ModelService, name: str, data: bytes, config: dict | None = None, **kwargs):
    """Register and return the served model itself (tests then swap its engines) once its padding probe,
    which runs after the upload answers, has put its verdicts in force."""
    served = service.admission.register(name, lambda: load_model(data, max_bytes=len(data)), config, **kwargs)
    probed(service, name)
    return served


def register(service: ModelService, name: str, data: bytes, config: dict | None = None, **kwargs) -> dict:
    """``service.register``, then wait for the model's padding probe: its verdicts, warm buckets in force."""
    described = service.register(name, data, config, **kwargs)
    probed(service, name)
    return described


def probed(service: ModelService, name: str, timeout: float = 60) -> None:
    """Wait until the served model's padding probe is done."""
    probe = service.get(name).padding_probe
    assert probe.wait(timeout), f"{name}'s padding probe did not end within {timeout} s"
    assert probe.state == "done", (probe.state, probe.error)
