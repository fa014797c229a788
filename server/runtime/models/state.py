"""The lifecycle of one bucket of one served model, as a typed state machine.

    cold ──► admitted ──► compiling ──► ready ◄─┐ (re-routed after tuning)
     ▲  │  ◄──┘ (queue full)   ▲     └──► failed     │
     │  │                      └──────────┘ (retried: the failure may pass)
     │  └────────────────────────────► ready ─────┘ (route restored from an earlier process)
     └──────────────────────────────── ready        (evicted: the model's coldest compiled bucket)

A bucket is ``cold`` (served by ONNX Runtime) until compile admission finds
it has earned a compile (see :mod:`.compile_admission`).

Every write goes through a method that takes the bucket's lock; a move the
table does not allow raises :class:`IllegalTransitionError`. Counters are
updated under the same lock, so concurrent requests never lose a hit.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from enum import StrEnum

from pydantic import BaseModel, model_serializer

from compiler.errors import IllegalTransitionError
from compiler.shapes.buckets import Bucket, is_symbolic


class BucketState(StrEnum):
    COLD = "cold"
    ADMITTED = "admitted"
    COMPILING = "compiling"
    READY = "ready"
    FAILED = "failed"


LEGAL_MOVES: dict[BucketState, frozenset[BucketState]] = {
    BucketState.COLD: frozenset({BucketState.ADMITTED, BucketState.READY}),
    BucketState.ADMITTED: frozenset({BucketState.COLD, BucketState.COMPILING}),
    BucketState.COMPILING: frozenset({BucketState.READY, BucketState.FAILED}),
    BucketState.READY: frozenset({BucketState.READY, BucketState.COLD}),
    BucketState.FAILED: frozenset({BucketState.ADMITTED}),
}


class TuningState(StrEnum):
    TUNING = "tuning"
    DONE = "done"
    FAILED = "failed"


class CompileEvent(BaseModel):
    """One compile of a bucket: when, why, what its key was made of, and what changed since the one before."""

    at: float
    reason: str
    """``first_compile``, a recompile's reason (``new_model_version``, ``target_or_compiler_changed``,
    ``artifact_missing``) or ``tuned``."""
    key: str
    facts: dict[str, str | int | None]
    """What the key was made of: model version, graph, target, TVM, compiler version, tuning."""
    changed: list[str] = []
    """The facts that differ from the compile before (none for a first compile)."""
    compile_seconds: float
    verified: bool | None = None


HISTORY_LENGTH = 20
"""Compiles remembered per bucket, newest last."""
BF16_TIER = "tvm-bf16"
"""The engine name of a bucket's TVM kernel in bf16 (``compiler/tvm/bf16.py``), beside ``tvm`` and ``tvm-tuned``."""


class TuningStatus(BaseModel):
    """Background tuning of one bucket, as shown in ``GET /models/{name}`` and persisted."""

    state: TuningState
    trials: int | None = None
    best_ms: float | None = None
    """Estimated time of the tuned kernel from the candidates measured so far."""
    tasks: int | None = None
    seconds: float | None = None
    reason: str | None = None
    measured_on: str | None = None
    """Where the candidates ran: ``local``, or ``rpc <tracker> <key> x<servers>``."""
    plan: list[dict] | None = None
    """Its kernels, those that lose most to ONNX Runtime first: each one's share of the run, its ratio
    against ONNX Runtime on the same nodes, the trials it got, and why none where it got none."""

    @model_serializer(mode="wrap")
    def _only_known(self, handler) -> dict:
        # A fact that is not known (no trials before a failure) is left out rather than null.
        return {key: value for key, value in handler(self).items() if value is not None}


RUNS_TO_TELL = 8
"""Runs of a bucket's engine seen before the inline decision is taken."""
RUN_WINDOW = 32
"""A bucket's latest runs whose fastest says what its engine costs."""
RECENT_HITS_KEPT = 64
"""Times of a bucket's latest hits kept: enough for any compile admission threshold."""
MAX_SIZES_SEEN = 4096
"""Distinct request sizes a symbolic bucket remembers (a storm counts each once)."""


class BucketTraffic:
    """A bucket's requests: how many, how recent (compile admission's threshold, and the decaying heat that
    orders compiles and evictions), and which sizes a symbolic bucket has had."""

    def __init__(self) -> None:
        self._hits = 0
        self._recent_hits: deque[float] = deque(maxlen=RECENT_HITS_KEPT)
        self._heat = 0.0
        self._heat_at = 0.0
        self._heat_window = 60.0
        self.first_seen: float | None = None
        """When compile admission first considered the bucket (monotonic seconds); None before."""
        self._sizes_seen: set[tuple] = set()
        self._lock = threading.Lock()

    def first_time_size(self, sizes: tuple) -> bool:
        """Whether a symbolic bucket has not had a request of these sizes before (each is a new shape to
        a storm count, though no new compile). Counts up to ``MAX_SIZES_SEEN`` sizes."""
        with self._lock:
            if sizes in self._sizes_seen or len(self._sizes_seen) >= MAX_SIZES_SEEN:
                return False
            self._sizes_seen.add(sizes)
            return True

    def record_hit(self, now: float | None = None, *, window: float = 60.0) -> None:
        """One request; ``window`` (seconds) is the time constant of the bucket's decaying traffic."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._hits += 1
            self._recent_hits.append(now)
            self._heat = self._heat * math.exp((self._heat_at - now) / window) + 1.0
            self._heat_at, self._heat_window = now, window

    @property
    def hits(self) -> int:
        return self._hits

    def hits_within(self, seconds: float, now: float, at_least: int) -> bool:
        """At least ``at_least`` hits in the last ``seconds`` (at most ``RECENT_HITS_KEPT`` are counted)."""
        recent = self._recent_hits
        return len(recent) >= at_least and now - recent[-at_least] <= seconds

    def heat(self, now: float) -> float:
        """Its recent traffic: hits, each decaying with the window's time constant. Orders compiles and
        evictions."""
        return self._heat * math.exp((self._heat_at - now) / self._heat_window)


class ServedBucket:
    """One bucket of a served model: its state, route, measured latencies, tuning and hits."""

    def __init__(
        self,
        label: str,
        bucket: Bucket,
        key: str,
        *,
        warm: bool = False,
        verify_sizes: dict | None = None,
        history: list[CompileEvent] | None = None,
        demoted: dict[str, str] | None = None,
    ) -> None:
        self.label = label
        self.bucket = bucket
        self.symbolic = is_symbolic(bucket)
        """A bucket of the dynamic tier: a symbolic kernel for a range of sizes."""
        self.verify_sizes = verify_sizes
        """A symbolic bucket's sizes its kernel is verified at (part of its key); None for a static one."""
        self.key = key
        self.warm = warm
        self.state = BucketState.COLD
        self.reason: str | None = None
        self.compile_seconds: float | None = None
        self.route: str | None = None
        self.latency_ms: dict[str, float] = {}
        self.throughput_rps: dict[str, float] = {}
        """Per engine, requests per second at ``peak_concurrency`` callers (routed by throughput only)."""
        self.routed_by = "latency"
        """What the route was chosen by: one request's latency, or throughput at the peak concurrency."""
        self.peak_concurrency = 1
        """Most of its requests seen running at once."""
        self.overlapped_runs = 0
        """Its runs that started beside another of its runs since it was last routed."""
        self._in_flight = 0
        self.demoted: dict[str, str] = dict(demoted or {})
        """Kernel key -> why a shadow check took it off this bucket: never routed again."""
        self.padded_error: dict[str, float] = {}
        """Per kernel, its largest difference from ONNX Runtime on the bucket's most padded request."""
        self.tuned_key: str | None = None
        self.bf16: dict | None = None
        """TVM's bf16 tier where the model's precision contract allows bf16: its kernel's key and verification,
        or why it cannot serve (:data:`BF16_TIER`)."""
        self.openvino: dict[str, dict] | None = None
        """Per OpenVINO engine (``openvino``, and a reduced precision's): its build's key, bytes, precision and
        verification, or why it cannot serve."""
        self.tuning: TuningStatus | None = None
        self.attempts = 0
        """Compiles tried (retries included)."""
        self._history: list[CompileEvent] = list(history or [])
        self.retry_in: float | None = None
        """Failed for a reason that may pass: seconds until its retry (None: no retry)."""
        self.traffic = BucketTraffic()
        self._recent_runs: deque[float] = deque(maxlen=RUN_WINDOW)
        self._run_floor_ms = math.inf
        self._lock = threading.Lock()

    # -- transitions -----------------------------------------------------

    def move(self, to: BucketState, *, only_from: BucketState | None = None, reason: str | None = None) -> bool:
        """Move to ``to``; False (and no change) when ``only_from`` is given and the state is another."""
        with self._lock:
            if only_from is not None and self.state is not only_from:
                return False
            self._check(to)
            self.state, self.reason = to, reason
            if to is BucketState.ADMITTED:
                self.retry_in = None
            return True

    def fail(self, reason: str, *, retry_in: float | None = None) -> None:
        with self._lock:
            self._check(BucketState.FAILED)
            self.state, self.reason, self.retry_in = BucketState.FAILED, reason, retry_in

    def stop_retrying(self, reason: str) -> None:
        """A failed bucket's pending retry is called off."""
        with self._lock:
            if self.state is BucketState.FAILED:
                self.reason, self.retry_in = reason, None

    @property
    def retry_pending(self) -> bool:
        return self.state is BucketState.FAILED and self.retry_in is not None

    def serve(
        self,
        route: str,
        latency_ms: dict[str, float],
        *,
        compile_seconds: float | None = None,
        padded_error: dict[str, float] | None = None,
        throughput_rps: dict[str, float] | None = None,
        reason: str | None = None,
    ) -> None:
        """Ready, served by ``route`` (first routing, a restored route or a re-route after tuning); by
        throughput when ``throughput_rps`` is given, else by latency; ``reason`` says why, if anything
        kept a faster engine off."""
        with self._lock:
            self._check(BucketState.READY)
            self.state, self.reason, self.route = BucketState.READY, reason, route
            self.latency_ms = {engine: round(ms, 4) for engine, ms in latency_ms.items()}
            self.throughput_rps = {engine: round(rps, 1) for engine, rps in (throughput_rps or {}).items()}
            self.routed_by = "throughput" if throughput_rps else "latency"
            self.overlapped_runs = 0
            if padded_error is not None:
                self.padded_error = {engine: float(f"{error:.3g}") for engine, error in padded_error.items()}
            if compile_seconds is not None:
                self.compile_seconds = compile_seconds

    def demote(self, engine: str, reason: str) -> bool:
        """``engine``'s kernel answered wrong: ONNX Runtime serves the bucket, and the kernel's key is kept
        out for good. False if ``engine`` no longer serves it."""
        with self._lock:
            key = self.key_for(engine)
            if self.state is not BucketState.READY or self.route != engine or key is None:
                return False
            self.route, self.reason = "onnxruntime", reason
            self.demoted = {**self.demoted, key: reason}
            return True

    def _check(self, to: BucketState) -> None:
        if to not in LEGAL_MOVES[self.state]:
            raise IllegalTransitionError(f"bucket {self.label}: {self.state} -> {to} is not a legal move")

    # -- facts that are not states ---------------------------------------

    def compiled(self, seconds: float) -> None:
        with self._lock:
            self.compile_seconds = seconds

    def add_compile(self, event: CompileEvent) -> CompileEvent:
        """Remember a compile; its ``changed`` is filled against the one before."""
        with self._lock:
            if self._history:
                before = self._history[-1].facts
                event = event.model_copy(update={"changed": [k for k, v in event.facts.items() if before.get(k) != v]})
            self._history = [*self._history, event][-HISTORY_LENGTH:]
            return event

    @property
    def history(self) -> list[CompileEvent]:
        with self._lock:
            return list(self._history)

    def set_tuning(self, status: TuningStatus | None, *, tuned_key: str | None = None) -> None:
        with self._lock:
            self.tuning = status
            if tuned_key is not None:
                self.tuned_key = tuned_key

    def evict(self, reason: str) -> bool:
        """A ready bucket goes back to ``cold`` (ONNX Runtime serves it); False if it was not ready."""
        with self._lock:
            if self.state is not BucketState.READY:
                return False
            self.state, self.reason, self.route = BucketState.COLD, reason, None
            return True

    def note(self, reason: str) -> None:
        """Why the bucket is in its state (e.g. why a cold bucket is not admitted yet)."""
        if reason != self.reason:
            with self._lock:
                self.reason = reason

    def begin_run(self) -> None:
        """A request starts running (``observe_run`` ends it): counts how many run at once."""
        with self._lock:
            self._in_flight += 1
            self.peak_concurrency = max(self.peak_concurrency, self._in_flight)
            self.overlapped_runs += self._in_flight > 1

    def observe_run(self, ms: float | None) -> None:
        """One run of the engine serving the bucket ends (``None``: it failed); its time is averaged
        over the recent ones."""
        with self._lock:
            self._in_flight = max(0, self._in_flight - 1)
            if ms is None:
                return
            self._recent_runs.append(ms)
            self._run_floor_ms = min(self._recent_runs)

    def recent_floor_ms(self, runs: int = RUNS_TO_TELL) -> float | None:
        """The fastest of its last ``runs`` runs, in ms; None before that many."""
        with self._lock:
            recent = list(self._recent_runs)[-runs:]
        return min(recent) if len(recent) >= runs else None

    @property
    def run_floor_ms(self) -> float | None:
        """The fastest of its recent runs (what :meth:`runs_below` reads); None before enough of them."""
        return self._run_floor_ms if len(self._recent_runs) >= RUNS_TO_TELL else None

    def runs_below(self, ms: float) -> bool:
        """The fastest of its recent runs took less than ``ms`` (after enough of them to tell). Not their
        average: a run's wall time also holds the wait for Python's GIL once the engine returns, up to the
        switch interval (5 ms) on a busy inference thread, and an average those waits inflate can keep a tiny
        model on the pool, where its runs wait again."""
        return len(self._recent_runs) >= RUNS_TO_TELL and self._run_floor_ms < ms

    @property
    def serves_kernel_key(self) -> str | None:
        """The artifact key of the kernel serving this bucket; None while ONNX Runtime serves it."""
        if self.state is not BucketState.READY:
            return None
        return self.key_for(self.route)

    @property
    def stored_keys(self) -> list[str]:
        """The store keys of its compiled kernels: fp32, tuned, bf16."""
        return [key for key in (self.key, self.tuned_key, (self.bf16 or {}).get("key")) if key]

    def key_for(self, engine: str | None) -> str | None:
        bf16 = (self.bf16 or {}).get("key")
        compiled = {"tvm": self.key, "tvm-tuned": self.tuned_key, BF16_TIER: bf16}.get(engine or "")
        return compiled or ((self.openvino or {}).get(engine or "") or {}).get("key")

    def describe(self) -> dict:
        with self._lock:
            return {
                "bucket": self.label,
                "shapes": {k: list(v) for k, v in self.bucket.items()},
                "state": self.state.value,
                "reason": self.reason,
                "engine": self.route if self.state is BucketState.READY and self.route else "onnxruntime",
                "latency_ms": dict(self.latency_ms),
                "routed_by": self.routed_by,
                "throughput_rps": dict(self.throughput_rps),
                "peak_concurrency": self.peak_concurrency,
                "padded_error": dict(self.padded_error),
                "demoted": dict(self.demoted),
                "compile_seconds": self.compile_seconds,
                "kernel": self.key,
                "openvino": {engine: dict(facts) for engine, facts in self.openvino.items()} if self.openvino else None,
                "tvm_bf16": dict(self.bf16) if self.bf16 else None,
                "hits": self.traffic.hits,
                "traffic": round(self.traffic.heat(time.monotonic()), 3),
                "warm": self.warm,
                "tuning": self.tuning.model_dump(mode="json") if self.tuning else None,
            }
