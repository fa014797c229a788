"""Where a bucket's time goes: each compiled kernel beside ONNX Runtime's nodes.

TVM 0.27 has no VM profiler any more, so :func:`kernel_profile` times every
call the Relax VM makes through ``VirtualMachine.set_instrument`` (compiled
kernels and the VM's own builtins such as allocations). :func:`ort_profile`
reads ONNX Runtime's own per-node profile (``enable_profiling``) of the same
input. Both sides are grouped into op classes (contraction, normalization,
elementwise, ...) so that the families where one engine loses show up even
though the two engines fuse differently. Used by ``python -m compiler bench
--profile``; the result is plain data, ready to be shown to users.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import onnx
import onnxruntime as ort

from ..running.engines import ort_session_options

# Op classes, by the leading op of a TVM kernel's name or an ONNX Runtime op type (lower case).
_CLASSES = {
    "contraction": (
        "conv",
        "convtranspose",
        "matmul",
        "batch_matmul",
        "dense",
        "gemm",
        "fusedconv",
        "fusedgemm",
        "fusedmatmul",
        "attention",
        "multiheadattention",
        "pool",
        "max_pool",
        "avg_pool",
        "adaptive_avg_pool",
        "maxpool",
        "averagepool",
        "globalaveragepool",
        "nchwcconv",
        "einsum",
    ),
    "normalization": (
        "layer_norm",
        "layernormalization",
        "skiplayernormalization",
        "softmax",
        "log_softmax",
        "mean",
        "sum",
        "max",
        "min",
        "variance",
        "reducemean",
        "reducesum",
        "reducemax",
        "batchnorm",
        "instancenorm",
        "group_norm",
        "rms_norm",
        "simplifiedlayernormalization",
    ),
    "layout": (
        "transpose",
        "reshape",
        "concat",
        "split",
        "strided_slice",
        "slice",
        "take",
        "gather",
        "pad",
        "reordertensor",
        "reorderinput",
        "reorderoutput",
        "squeeze",
        "unsqueeze",
        "flatten",
        "expand_dims",
        "broadcast_to",
        "dynamic_strided_slice",
        "resize",
        "image",
        "layout_transform",
        "copy",
        "cast",
    ),
}
_CLASS_OF = {prefix: name for name, prefixes in _CLASSES.items() for prefix in prefixes}


def op_class(name: str) -> str:
    """``contraction``, ``normalization``, ``layout`` or ``elementwise`` for a kernel or op name.

    A fused TVM kernel is named after its ops in order (``fused_conv2d_add_relu``): its
    first op decides. VM builtins (allocation, shape checks) are ``runtime``.
    """
    lowered = name.lower()
    if lowered.startswith("vm.") or "." in lowered:
        return "runtime"
    lowered = re.sub(r"^fused_", "", lowered)
    # The longest prefix that ends a word: "max" is a reduction, "maximum" is not.
    best = ""
    for prefix in _CLASS_OF:
        rest = lowered[len(prefix) : len(prefix) + 1]
        if lowered.startswith(prefix) and not rest.isalpha() and len(prefix) > len(best):
            best = prefix
    return _CLASS_OF[best] if best else "elementwise"


@dataclass
class OpTime:
    name: str
    op_class: str
    calls: int
    ms: float  # per run of the whole model
    share: float = 0.0


@dataclass
class Profile:
    """One engine's profile of one input: entries slowest first, times per model run."""

    engine: str
    runs: int
    total_ms: float
    entries: list[OpTime] = field(default_factory=list)
    trace: list[dict] = field(default_factory=list)
    """The last run as Chrome-trace events (``ph: X``, microseconds from its start)."""
    started_ns: list[int] = field(default_factory=list)
    """When each timed run started (wall clock, ns): how two engines' runs took turns."""

    def by_class(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for entry in self.entries:
            totals[entry.op_class] = totals.get(entry.op_class, 0.0) + entry.ms
        return totals

    def as_dict(self, top: int | None = None) -> dict:
        entries = self.entries[:top] if top else self.entries
        return {
            "engine": self.engine,
            "runs": self.runs,
            "total_ms": round(self.total_ms, 4),
            "by_class_ms": {k: round(v, 4) for k, v in sorted(self.by_class().items(), key=lambda kv: -kv[1])},
            "entries": [asdict(e) | {"ms": round(e.ms, 4), "share": round(e.share, 4)} for e in entries],
        }


def _finish(
    engine: str, runs: int, sums: dict[str, list], total_ms: float, trace: list[dict], *, started_ns: list[int]
) -> Profile:
    # A node's entry carries its op type (a third item), which names its class.
    entries = [
        OpTime(name, op_class(kind[0] if kind else name), calls // runs, seconds * 1000 / runs)
        for name, (calls, seconds, *kind) in sums.items()
    ]
    entries.sort(key=lambda e: -e.ms)
    accounted = sum(e.ms for e in entries) or 1.0
    for entry in entries:
        entry.share = entry.ms / accounted
    return Profile(engine, runs, total_ms, entries, trace, started_ns)


class KernelProfiler:
    """Per-call times of a loaded :class:`~compiler.running.engines.TvmEngine`, one run at a time (so that its
    runs can alternate with ONNX Runtime's: a machine's load then weighs on both profiles alike).

    Each VM call is timed from the instrument's before-hook to its after-hook. The hooks' own cost
    inside that window (the return to the VM and the call into Python again) is what the cheapest
    call measured (a builtin such as ``vm.builtin.null_value`` does nothing): it is taken off every call.
    PP-OCR cls (0.33 ms, 250 calls a run): the calls added up to 1.3x its plain run without it, 1.1-1.2x
    with it (the hooks between kernels of a few microseconds cost more than the cheapest call shows).
    """

    def __init__(self, engine, inputs: dict[str, np.ndarray]) -> None:
        self.engine, self.inputs = engine, inputs
        self.sums: dict[str, list] = {}
        self.runs = 0
        self.seconds = 0.0
        self.started_ns: list[int] = []
        self._started: list[float] = []
        self._calls: list[tuple[str, float, float]] = []  # the current run's (symbol, start, end)
        self._run_started = 0.0

    def _instrument(self, func, symbol, before_run, ret_value, *args):
        if before_run:
            self._started.append(time.perf_counter())
        else:
            end, start = time.perf_counter(), self._started.pop()
            entry = self.sums.setdefault(str(symbol), [0, 0.0])
            entry[0] += 1
            entry[1] += end - start
            self._calls.append((str(symbol), start, end))
        return 0

    def run(self) -> None:
        """One instrumented run."""
        self._calls.clear()
        self.engine.set_instrument(self._instrument)
        try:
            self.started_ns.append(time.time_ns())
            self._run_started = time.perf_counter()
            self.engine.run(self.inputs)
            self.seconds += time.perf_counter() - self._run_started
        finally:
            self.engine.set_instrument(None)
        self.runs += 1

    def profile(self) -> Profile:
        hook = min((seconds / count for count, seconds in self.sums.values() if count), default=0.0)
        sums = {name: [count, max(0.0, seconds - hook * count)] for name, (count, seconds) in self.sums.items()}
        trace = [
            {"name": name, "cat": op_class(name), "ph": "X", "ts": (start - self._run_started) * 1e6,
             "dur": max(0.0, end - start - hook) * 1e6}
            for name, start, end in self._calls
        ]  # fmt: skip
        total_ms = self.seconds * 1000 / max(1, self.runs)
        return _finish("tvm", self.runs, sums, total_ms, trace, started_ns=self.started_ns)


def kernel_profile(engine, inputs: dict[str, np.ndarray], *, runs: int = 10, warmup: int = 2) -> Profile:
    """Per-call times of a loaded :class:`~compiler.running.engines.TvmEngine` on ``inputs`` (:class:`KernelProfiler`),
    ``runs`` in a row after ``warmup`` plain ones."""
    for _ in range(warmup):
        engine.run(inputs)
    profiler = KernelProfiler(engine, inputs)
    for _ in range(runs):
        profiler.run()
    return profiler.profile()


def named_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every unnamed node named by its first output, as the TVM importer names it: ONNX
    Runtime's profile names each node's event after the node, and a kernel's nodes are matched to those
    events by these names."""
    for node in model.graph.node:
        if not node.name and node.output:
            node.name = node.output[0]
    return model


class OrtProfiler:
    """ONNX Runtime's per-node profile of ``inputs``, one run at a time, grouped by op type (``by="op"``) or
    by node name as ONNX Runtime ran it (``by="node"``: after its own fusions and layout changes).

    Only the runs after the first ``warmup`` count: the profile's events are cut at the end of the last
    warm-up ``model_run``. ``spinning=False`` stops its idle threads spinning between runs, as the server
    runs them: spinning, they hold the cores a TVM run right after one needs.
    """

    def __init__(
        self,
        model_bytes: bytes,
        inputs: dict[str, np.ndarray],
        *,
        warmup: int = 2,
        threads: int | None = None,
        by: str = "op",
        spinning: bool = True,
    ) -> None:
        options = ort_session_options(threads=threads, spinning=spinning)
        self._folder = tempfile.TemporaryDirectory(prefix="jitserve-ort-profile-")
        options.enable_profiling = True
        options.profile_file_prefix = os.path.join(self._folder.name, "ort")
        self.session = ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])
        self.inputs, self.warmup, self.by = inputs, warmup, by
        self.runs = 0

    def run(self) -> None:
        self.session.run(None, self.inputs)
        self.runs += 1

    def profile(self) -> Profile:
        """The profile of the runs after the warm-up ones; ends the session's profiling."""
        try:
            with open(self.session.end_profiling()) as file:
                events = json.load(file)
        finally:
            self._folder.cleanup()
        start_ns = self.session.get_profiling_start_time_ns()  # the events' clock: microseconds from it
        return _ort_events_profile(events, self.runs - self.warmup, self.warmup, self.by, start_ns)


def ort_profile(
    model_bytes: bytes,
    inputs: dict[str, np.ndarray],
    *,
    runs: int = 10,
    warmup: int = 2,
    threads: int | None = None,
    by: str = "op",
) -> Profile:
    """:class:`OrtProfiler`'s profile of ``runs`` runs in a row after ``warmup`` ones."""
    profiler = OrtProfiler(model_bytes, inputs, warmup=warmup, threads=threads, by=by)
    for _ in range(warmup + runs):
        profiler.run()
    return profiler.profile()


def _ort_events_profile(events: list[dict], runs: int, warmup: int, by: str, start_ns: int) -> Profile:
    model_runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    if runs < 1 or len(model_runs) < warmup + runs:
        raise RuntimeError("ONNX Runtime's profile lacks model runs")
    timed = model_runs[warmup:]
    cut = model_runs[warmup - 1]["ts"] + model_runs[warmup - 1]["dur"] if warmup else -1
    last = model_runs[-1]
    sums: dict[str, list] = {}
    trace = []
    for event in events:
        if event.get("cat") != "Node" or not str(event.get("name", "")).endswith("_kernel_time") or event["ts"] < cut:
            continue
        op = str(event.get("args", {}).get("op_name", "?"))
        node = event["name"].removesuffix("_kernel_time")
        entry = sums.setdefault(op, [0, 0.0]) if by == "op" else sums.setdefault(node, [0, 0.0, op])
        entry[0] += 1
        entry[1] += event["dur"] / 1e6
        if event["ts"] >= last["ts"]:
            trace.append({"name": node, "cat": op_class(op), "ph": "X", "ts": event["ts"] - last["ts"],
                          "dur": event["dur"], "args": {"op": op}})  # fmt: skip
    total_ms = sum(e["dur"] for e in timed) / 1000 / runs
    started_ns = [start_ns + int(e["ts"]) * 1000 for e in timed]
    return _finish("onnxruntime", runs, sums, total_ms, trace, started_ns=started_ns)


def compare_by_class(tvm: Profile, onnxruntime: Profile) -> list[dict]:
    """Both engines' milliseconds per op class, with TVM's ratio, slowest TVM class first."""
    ours, theirs = tvm.by_class(), onnxruntime.by_class()
    rows = []
    for name in sorted(set(ours) | set(theirs), key=lambda k: -ours.get(k, 0.0)):
        tvm_ms, ort_ms = ours.get(name, 0.0), theirs.get(name, 0.0)
        ratio = round(tvm_ms / ort_ms, 2) if ort_ms > 0 else None
        rows.append({"op_class": name, "tvm_ms": round(tvm_ms, 4), "ort_ms": round(ort_ms, 4), "tvm_over_ort": ratio})
    return rows


def format_profile(label: str, tvm: Profile, onnxruntime: Profile, *, top: int = 12) -> str:
    """A text report: the class comparison, then each engine's slowest entries."""
    lines = [f"== {label}: TVM {tvm.total_ms:.3f} ms/run, ONNX Runtime {onnxruntime.total_ms:.3f} ms/run"]
    lines.append(f"{'op class':<16}{'TVM ms':>10}{'ORT ms':>10}{'TVM/ORT':>9}")
    for row in compare_by_class(tvm, onnxruntime):
        ratio = "-" if row["tvm_over_ort"] is None else f"{row['tvm_over_ort']:.2f}"
        lines.append(f"{row['op_class']:<16}{row['tvm_ms']:>10.3f}{row['ort_ms']:>10.3f}{ratio:>9}")
    for profile in (tvm, onnxruntime):
        lines.append(f"-- {profile.engine}: slowest {min(top, len(profile.entries))} of {len(profile.entries)}")
        for entry in profile.entries[:top]:
            lines.append(f"{entry.ms:9.3f} ms {entry.share:6.1%} x{entry.calls:<3} {entry.op_class:<14} {entry.name}")
    return "\n".join(lines)
