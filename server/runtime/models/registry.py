"""The models being served, in memory: one :class:`ServedModel` per name.

A model version is replaced whole: requests in flight finish on the version
they started with, and the replaced version is marked retired so that its
compiles and tuning stop touching the store.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from compiler.building.options import CompileOptions
from compiler.errors import NotFoundError
from compiler.models.model import LoadedModel
from compiler.running.arrays import Comparison, compare_outputs
from compiler.running.engines import OrtEngine
from compiler.running.precision import budget_for, compare_within_budget
from compiler.shapes.buckets import AxisSafety, Bucket, BucketPlanner, bucket_label, is_symbolic

from ..serving.batch_verdicts import BatchVerdicts
from ..serving.batcher import DynamicBatcher
from .records import ModelRecord
from .state import BucketState, ServedBucket


class PaddingProbe:
    """Where a model version's padding probe is: ``pending`` (waiting for a probe slot), ``running``,
    ``done`` (its verdicts in force), ``failed`` (its axes served exactly; ``error`` says why) or
    ``cancelled`` (the version was deleted, replaced or unloaded, or the server shut down). A version with
    no axis to probe, or with the verdicts of the current probe stored, is ``done`` from the start."""

    def __init__(self, *, pending: bool = False) -> None:
        self.state = "pending" if pending else "done"
        self.error: str | None = None
        self.cancelled = threading.Event()
        """Set when the version is retired or the server shuts down: the probe stops before its next run."""
        self._started: float | None = None
        self._seconds: float | None = None
        self._settled = threading.Event()
        if not pending:
            self._settled.set()

    @property
    def settled(self) -> bool:
        """Ended one way or another: the model's verdicts, if it is still served, are in force."""
        return self._settled.is_set()

    def begin(self) -> None:
        self._started = time.monotonic()
        self.state = "running"

    def end(self, state: str, error: str | None = None) -> None:
        if self._started is not None:
            self._seconds = time.monotonic() - self._started
        self.state, self.error = state, error
        self._settled.set()

    @property
    def seconds(self) -> float | None:
        """The probe's wall time (so far, while it runs); None when none ran in this process."""
        if self.state == "running" and self._started is not None:
            return time.monotonic() - self._started
        return self._seconds

    def wait(self, timeout: float | None = None) -> bool:
        """Until the probe has ended; False when ``timeout`` passed first."""
        return self._settled.wait(timeout)

    def describe(self) -> dict:
        seconds = self.seconds
        return {"state": self.state, "seconds": None if seconds is None else round(seconds, 3), "error": self.error}


@dataclass
class ServedModel:
    """One version of one model: its record, ONNX Runtime session, bucket planner and buckets."""

    record: ModelRecord
    model: LoadedModel
    planner: BucketPlanner
    ort: OrtEngine
    target: dict
    options: CompileOptions
    key_of: Callable[..., str]
    buckets: dict[str, ServedBucket] = field(default_factory=dict)
    batcher: DynamicBatcher | None = None
    batching: str | None = None
    """Why requests are or are not joined into batches (None: batching not configured)."""
    batch_verdicts: BatchVerdicts | None = None
    """Per group of its requests, whether batching pays (its buckets' measured runs)."""
    retired: bool = False
    new_buckets: deque[float] = field(default_factory=deque)
    """When each bucket first seen lately was seen (compile admission's storm watch)."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    padding_probe: PaddingProbe = field(default_factory=PaddingProbe)
    """Until it has ended, the axes it judges have no verdict: they are served exactly (nothing padded)."""

    def retire(self) -> None:
        """Replaced or unloaded: compiles and tuning stop touching the store, queued batches still run, a
        padding probe still running stops."""
        with self.lock:  # a batcher started by a probe's verdicts meanwhile is closed too
            self.retired = True
            batcher = self.batcher
        self.padding_probe.cancelled.set()
        if batcher is not None:
            batcher.close()

    @property
    def name(self) -> str:
        return self.record.name

    def compare(self, engine: str, actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> Comparison:
        """An engine's answers against ONNX Runtime's: a reduced-precision engine's within the precision
        contract's budget; any other's within the verification tolerances (an int8 model's dequantized
        outputs within one quantization step)."""
        budget = budget_for(engine, self.record.config.precision, bool(self.model.integer_ops))
        if budget is not None:
            return compare_within_budget(actual, expected, budget)
        options = self.options
        return compare_outputs(actual, expected, options.rtol, options.atol, steps=self.model.output_steps)

    @property
    def dtypes(self) -> dict[str, str]:
        return {spec.name: spec.dtype for spec in self.model.signature.inputs}

    def bucket_for(self, bucket: Bucket) -> ServedBucket:
        """The bucket's lifecycle object, created on first sight."""
        label = bucket_label(bucket)
        with self.lock:
            served = self.buckets.get(label)
            if served is None:
                sizes = self.planner.verify_sizes(bucket) if is_symbolic(bucket) else None
                key = self.key_of(bucket, verify_sizes=sizes)
                known = self.record.buckets.get(label)
                served = self.buckets[label] = ServedBucket(
                    label,
                    bucket,
                    key,
                    verify_sizes=sizes,
                    history=known.history if known else None,
                    demoted=known.demoted if known else None,
                )
            return served

    def _put_safety(self, verdicts: dict[str, AxisSafety], **fields) -> ModelRecord:
        """``verdicts`` (and ``fields``) into the record and the planner (hold :attr:`lock`)."""
        safety = {**self.record.safety, **verdicts}
        self.record = self.record.model_copy(update={"safety": safety, **fields})
        self.planner.safety = safety
        return self.record

    def settle_safety(self, verdicts: dict[str, AxisSafety], probe_version: int) -> ModelRecord:
        """The padding probe's verdicts in force: requests planned from now on are padded on the axes found
        safe. Returns the record that holds them."""
        with self.lock:
            return self._put_safety(verdicts, probe_version=probe_version)

    def revise_safety(self, verdicts: dict[str, AxisSafety]) -> None:
        """Axes found unsafe after upload: every request planned from now on is bucketed without padding
        them (buckets planned before keep their kernels, and see no more requests), and requests are no
        longer joined along a batch axis found so."""
        with self.lock:
            self._put_safety(verdicts)
            batch_axis = self.model.signature.leading_axis()
            if self.batcher is not None and batch_axis in verdicts:  # requests are joined along it no more
                self.batcher.close()
                self.batcher, self.batching = None, f"off: {verdicts[batch_axis].reason}"

    def find_bucket(self, bucket: Bucket) -> ServedBucket | None:
        return self.buckets.get(bucket_label(bucket))

    def all_buckets(self) -> list[ServedBucket]:
        with self.lock:
            return list(self.buckets.values())

    def waiting_warm_buckets(self) -> list[str]:
        """Warm buckets neither ready nor failed for good yet (a retry pending), as ``model:bucket``; while
        the padding probe runs, which buckets are warm is not known yet: ``model:padding-probe``."""
        if self.record.config.warm_buckets and not self.padding_probe.settled:
            return [f"{self.name}:padding-probe"]
        return [
            f"{self.name}:{b.label}"
            for b in self.all_buckets()
            if b.warm and (b.state not in (BucketState.READY, BucketState.FAILED) or b.retry_pending)
        ]

    def describe(self) -> dict:
        record, signature = self.record, self.model.signature
        return {
            "name": record.name,
            "version": record.version,
            "digest": record.digest,
            "target": self.target,
            "signature": signature.to_json(),
            "axes": {
                axis: {
                    "policy": self.planner.policies[axis].model_dump(),
                    "effective_policy": self.planner.effective_policy(axis).kind,
                    "padding_safety": record.safety[axis].model_dump() if axis in record.safety else None,
                }
                for axis in signature.axes()
            },
            "padding_probe": self.padding_probe.describe(),
            "overflow": record.config.overflow,
            "dynamic_batching": None
            if self.batching is None
            else {
                "enabled": self.batcher is not None,
                "reason": self.batching,
                "groups": self.batch_verdicts.describe() if self.batch_verdicts is not None else [],
                **(record.config.dynamic_batching.model_dump() if record.config.dynamic_batching else {}),
            },
            "buckets": [bucket.describe() for bucket in self.all_buckets()],
        }


class Registry:
    """Name -> the served version; swaps are atomic, and a replaced version is retired and handed to
    ``on_retire`` (which lets go of its kernels and weights)."""

    def __init__(self, on_retire: Callable[[ServedModel], None] = lambda served: None) -> None:
        self._models: dict[str, ServedModel] = {}
        self._lock = threading.Lock()
        self._on_retire = on_retire

    def get(self, name: str) -> ServedModel:
        served = self._models.get(name)
        if served is None:
            raise NotFoundError(f"model {name!r} not found")
        return served

    def find(self, name: str) -> ServedModel | None:
        return self._models.get(name)

    @property
    def names(self) -> list[str]:
        return sorted(self._models)

    def all(self) -> list[ServedModel]:
        return list(self._models.values())

    def put(self, served: ServedModel) -> None:
        with self._lock:
            previous = self._models.get(served.name)
            self._models[served.name] = served
        if previous is not None and previous is not served:
            previous.retire()
            self._on_retire(previous)

    def remove(self, name: str) -> ServedModel:
        with self._lock:
            served = self._models.pop(name, None)
        if served is None:
            raise NotFoundError(f"model {name!r} not found")
        served.retire()
        self._on_retire(served)
        return served
