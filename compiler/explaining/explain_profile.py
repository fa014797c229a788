"""Where a compiled bucket's time goes, kernel by kernel, beside ONNX Runtime on the same input.

The explain bundle maps each kernel to the ONNX nodes it computes; this module
times both engines (:mod:`.profile`) and joins them through those nodes: each
kernel's milliseconds beside the milliseconds ONNX Runtime spent on the same
nodes. ONNX Runtime's own nodes are named after the node they came from (a
fused ``Conv`` keeps the conv's name, a blocked-layout one adds ``_nchwc``),
so each of its events goes to the longest node name it starts with; the
layout reorders it inserts match none and are listed apart. Both profiles are
also written as Chrome traces (Perfetto, ``chrome://tracing``).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from ..building.options import read_source
from ..measuring.profile import KernelProfiler, OrtProfiler, Profile, compare_by_class, named_nodes, op_class
from ..measuring.timing import median_latencies_ms
from ..models.weights import load_weights
from ..running.arrays import random_inputs
from ..running.engines import OrtEngine, TvmEngine

PROFILE_FILE = "profile.json"
TRACE_DIR = "trace"
ENGINES = ("tvm", "onnxruntime")
PROFILE_WARMUP = 2


def profile_bucket(
    report: dict,
    engine,
    model_bytes: bytes,
    inputs: dict[str, np.ndarray],
    *,
    runs: int = 10,
    threads: int | None = None,
) -> tuple[dict, dict[str, Profile]]:
    """Time the loaded kernel and ONNX Runtime on ``inputs``: plain runs, then call by call and node by
    node. The two engines take turns run by run (the load of a shared machine, which moved every kernel's
    ratio by up to 1.5x between two profiles minutes apart when each engine ran its runs in a row, weighs
    on both alike), and ONNX Runtime's threads do not spin between runs, as the server runs them."""
    source = named_nodes(onnx.load_from_string(model_bytes))
    named = source.SerializeToString()
    # Plain runs too: profiling adds each engine's own bookkeeping to every call. The plain session is
    # gone before the profiling one opens: one copy of ONNX Runtime's weights at a time.
    ort_plain = OrtEngine(named, threads=threads, spinning=False)
    latency = median_latencies_ms({"tvm": engine, "ort": ort_plain}, inputs, runs=runs, block=1)
    del ort_plain
    tvm_side = KernelProfiler(engine, inputs)
    ort_side = OrtProfiler(named, inputs, warmup=PROFILE_WARMUP, threads=threads, by="node", spinning=False)
    for _ in range(PROFILE_WARMUP):
        engine.run(inputs)
        ort_side.run()
    for _ in range(runs):
        tvm_side.run()
        ort_side.run()
    tvm, onnxruntime = tvm_side.profile(), ort_side.profile()
    tvm_ms, ort_ms = latency["tvm"], latency["ort"]
    shapes = {name: list(array.shape) for name, array in inputs.items()}
    return join(report, source.graph, tvm, onnxruntime, tvm_ms, ort_ms) | {"input_shapes": shapes}, {
        "tvm": tvm,
        "onnxruntime": onnxruntime,
    }


def _node_matcher(report: dict, source: onnx.GraphProto):
    """ONNX Runtime's node name -> the index of the compiled graph's node that computes it.

    ONNX Runtime runs the uploaded graph: its node is a source node by name or by an output (a
    blocked-layout node is named after its output, ``conv1_out_nchwc``), else the longest of those it
    starts with (a node fused into another). A source node is the compiled node of its name or of one
    of its outputs, else the one reading the same weight (a MatMul and Add that became a Gemm); one that
    specialization folded away (a BatchNormalization folded into its conv) stands for the node that
    made its first input."""
    compiled = {node["name"]: node["index"] for node in report["nodes"] if node["name"]}
    compiled |= {output: node["index"] for node in report["nodes"] for output in node.get("outputs", [])}
    weights = {init.name for init in source.initializer}
    # A weight is read by the node that computes with it, under whatever name specialization gave the node.
    reader = {name: node["index"] for node in report["nodes"] for name in node.get("inputs", []) if name in weights}
    producer = {output: node for node in source.node for output in node.output}

    def compiled_index(node) -> int | None:
        named = (compiled[key] for key in (node.name, *node.output) if key in compiled)
        return next(named, next((reader[name] for name in node.input if name in reader), None))

    keys: dict[str, int] = {}
    for node in source.node:
        walked, hops = node, 0
        while walked is not None and compiled_index(walked) is None and walked.input and hops < 8:
            walked, hops = producer.get(walked.input[0]), hops + 1
        index = compiled_index(walked) if walked is not None else None
        if index is not None:
            for key in (node.name, *node.output):
                keys.setdefault(key, index)
    by_length = sorted(keys, key=len, reverse=True)

    def node_of(event_name: str) -> int | None:
        for candidate in (event_name, event_name.removesuffix("_nchwc")):
            if candidate in keys:
                return keys[candidate]
        return next((keys[key] for key in by_length if event_name.startswith(key)), None)

    return node_of


def join(  # noqa: PLR0917 - the two profiles and their plain runs, side by side
    report: dict, source: onnx.GraphProto, tvm: Profile, onnxruntime: Profile, tvm_run_ms: float, ort_run_ms: float
) -> dict:
    """Each kernel's time beside ONNX Runtime's time on the same ONNX nodes; what matched no kernel apart."""
    node_of = _node_matcher(report, source)
    tvm_entries = {entry.name: entry for entry in tvm.entries}
    # A node split over several kernels (a pointwise conv: a reshape, the matmul, its bias) is charged to
    # one of its own op class (the matmul), the slowest of those.
    holders: dict[int, list[str]] = defaultdict(list)
    for kernel in report["kernels"]:
        for index in kernel["nodes"]:
            holders[index].append(kernel["name"])
    kernel_of = {
        index: max(names, key=lambda k, i=index: (op_class(k) == op_class(report["nodes"][i]["op"]),
                                                   getattr(tvm_entries.get(k), "ms", 0.0)))
        for index, names in holders.items()
    }  # fmt: skip
    ort_by_kernel: dict[str, list] = defaultdict(list)
    ort_unmatched = []
    for entry in onnxruntime.entries:
        kernel = kernel_of.get(node_of(entry.name))
        (ort_by_kernel[kernel] if kernel else ort_unmatched).append(entry)
    rows = []
    for kernel in report["kernels"]:
        ours, theirs = tvm_entries.pop(kernel["name"], None), ort_by_kernel.get(kernel["name"], [])
        tvm_ms = ours.ms if ours else None
        ort_ms = sum(entry.ms for entry in theirs) if theirs else None
        rows.append(
            {
                "kernel": kernel["name"],
                "tvm_ms": _round(tvm_ms),
                "calls": ours.calls if ours else 0,
                "ort_ms": _round(ort_ms),
                "tvm_over_ort": round(tvm_ms / ort_ms, 2) if tvm_ms and ort_ms else None,
                "ort_nodes": [entry.name for entry in theirs],
            }
        )
    rows.sort(key=lambda row: -(row["tvm_ms"] or 0.0))
    called_ms = sum(entry.ms for entry in tvm.entries)
    nodes_ms = sum(entry.ms for entry in onnxruntime.entries)
    return {
        "tvm": {
            "run_ms": _round(tvm_run_ms),
            "instrumented_run_ms": _round(tvm.total_ms),
            "calls_ms": _round(called_ms),
        },
        "onnxruntime": {
            "run_ms": _round(ort_run_ms),
            "profiled_run_ms": _round(onnxruntime.total_ms),
            "nodes_ms": _round(nodes_ms),
        },
        # The kernels' and the VM's own calls against a plain run's median: how much of the run is accounted for.
        "accounted": round(called_ms / tvm_run_ms, 3) if tvm_run_ms else None,
        "kernels": rows,
        "tvm_other": [_entry(entry) for entry in sorted(tvm_entries.values(), key=lambda e: -e.ms)],
        "onnxruntime_unmatched": [_entry(entry) for entry in ort_unmatched],
        "by_class": compare_by_class(tvm, onnxruntime),
    }


def _entry(entry) -> dict:
    return {"name": entry.name, "op_class": entry.op_class, "calls": entry.calls, "ms": _round(entry.ms)}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def chrome_trace(profile: Profile, report: dict) -> dict:
    """One run of one engine as a Chrome trace; each TVM kernel's event names the ONNX nodes it computes."""
    nodes = {kernel["name"]: [report["nodes"][i]["name"] or report["nodes"][i]["op"] for i in kernel["nodes"]]
             for kernel in report["kernels"]}  # fmt: skip
    events = []
    for event in profile.trace:
        args = dict(event.get("args", {}))
        if event["name"] in nodes:
            args["onnx_nodes"] = nodes[event["name"]][:32]
        events.append(event | {"pid": 1, "tid": 1, "args": args})
    process = {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": profile.engine}}
    return {"traceEvents": [process, *events], "displayTimeUnit": "ms"}


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as file:
        file.write(text)
    os.replace(file.name, path)


def write_profile(directory: Path, report: dict, joined: dict, profiles: dict[str, Profile]) -> None:
    """``profile.json`` and ``trace/<engine>.json`` into a bundle, each replaced whole (a reader never sees
    half a file)."""
    for engine, profile in profiles.items():
        _write_atomically(directory / TRACE_DIR / f"{engine}.json", json.dumps(chrome_trace(profile, report)))
    _write_atomically(directory / PROFILE_FILE, json.dumps(joined, indent=1))


@dataclass(frozen=True)
class ProfileJob:
    """A stored kernel profiled in a child (:func:`profile_stored`), its result written into its bundle."""

    model_source: bytes | str
    library: str
    weights_dir: str
    weight_names: list[str]
    input_names: list[str]
    output_names: list[str]
    shapes: dict[str, list[int]]
    dtypes: dict[str, str]
    index_limits: dict[str, int]
    explain_dir: str
    runs: int = 10
    threads: int | None = None
    device: str = "llvm"


def profile_stored(job: ProfileJob) -> dict:
    """Load the kernel with its weights and ONNX Runtime's session, time both, write ``profile.json`` and
    the traces into the bundle; returns the profile."""
    directory = Path(job.explain_dir)
    report = json.loads((directory / "explain.json").read_text())
    weights = load_weights(Path(job.weights_dir))
    engine = TvmEngine(job.library, job.input_names, job.output_names, device=job.device,
                       weights=[weights[name] for name in job.weight_names])  # fmt: skip
    inputs = random_inputs({k: tuple(v) for k, v in job.shapes.items()}, job.dtypes, 1, job.index_limits)
    joined, profiles = profile_bucket(
        report, engine, read_source(job.model_source), inputs, runs=job.runs, threads=job.threads
    )
    write_profile(directory, report, joined, profiles)
    return joined
