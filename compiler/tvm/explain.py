"""What the compile did, for a bucket's explain bundle: which ONNX nodes each fused kernel computes.

TVM's importer keeps no spans. :class:`.onnx_import.Importer` names each node's
result binding after the node; this module follows those names through the
pipeline's snapshots:

- after legalization, every binding before a node's named one (the bindings
  its converter and its lowering emitted) belongs to that node;
- ``FuseOps`` keeps the bindings' order, and one fused function serves every
  group of the same structure: each call site claims, for each kernel its
  function calls, the earliest legalized binding of that kernel not claimed;
- ``FuseTIR`` turns each fused function into the kernel of the same name.

Runs in the compile child only (imports TVM).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tvm
from tvm import relax

from ..measuring.flops import node_flops
from ..measuring.profile import op_class
from ..running.engines import TRANSFORM_PARAMS


@dataclass(frozen=True)
class _Binding:
    name: str
    callee: str | None  # the kernel or fused function called, or the op


def _callee(value) -> str | None:
    if not isinstance(value, relax.Call):
        return None
    op = value.op
    name = getattr(op, "name_hint", None) or getattr(op, "name", None)
    if name == "relax.call_tir" and value.args:
        return getattr(value.args[0], "name_hint", None)
    return name


def bindings(func: relax.Function) -> list[_Binding]:
    return [_Binding(b.var.name, _callee(b.value)) for block in func.body.blocks for b in block.bindings]


def binding_nodes(legalized: list[_Binding], bound: dict[str, int]) -> list[int | None]:
    """Each binding of the legalized ``main``, by position -> the node it computes: a node's named binding,
    and every unnamed binding before it that no earlier node claimed. By position: the unnamed ones reuse
    their names (``lv``, ``lv1``, ... again after each converter), so by name, a residual net's stem conv
    was traced to a bottleneck's conv, whose binding took the same name later."""
    owners: list[int | None] = [None] * len(legalized)
    pending: list[int] = []
    for position, binding in enumerate(legalized):
        pending.append(position)
        if binding.name in bound:
            for claimed in pending:
                owners[claimed] = bound[binding.name]
            pending = []
    return owners


class StageRecorder:
    """The pipeline's ``snapshot``: each stage's IR as text, and the bindings the kernel map reads, taken
    when the stage ends (later stages change modules in place)."""

    def __init__(self, imported: tvm.IRModule) -> None:
        self.texts: dict[str, str] = {"import": imported.script()}
        self.legalized: list[_Binding] = []
        self.fused_main: list[_Binding] = []
        self.fused_functions: dict[str, list[_Binding]] = {}
        self.kernel_bytes: dict[str, int] = {}
        """Each kernel's parameters' bytes (what it reads and writes at least once), where static."""
        self.aliases = {
            b.var.name: b.value.name
            for block in imported["main"].body.blocks
            for b in block.bindings
            if isinstance(b.value, relax.Var)
        }
        """``main``'s bindings of one var to another at import (``gv = conv5``): later passes fold them, and
        the output then carries the alias's name alone."""

    def __call__(self, stage: str, mod: tvm.IRModule) -> None:
        self.texts[stage] = module_text(mod)
        for gv, func in mod.functions.items():
            if isinstance(func, tvm.tirx.PrimFunc) and (size := _param_bytes(func)) is not None:
                self.kernel_bytes[gv.name_hint] = size
        if stage == "legalize":
            self.legalized = bindings(mod["main"])
        elif stage == "fuse_ops":
            self.fused_main = bindings(mod["main"])
            self.fused_functions = {
                gv.name_hint: bindings(f)
                for gv, f in mod.functions.items()
                if isinstance(f, relax.Function) and gv.name_hint != "main"
            }


def module_text(mod: tvm.IRModule) -> str:
    """``mod`` as TVMScript, its lifted weight transform's functions left out: they run once per model
    version, not per request, and once lowered each prints the checks of every weight it is handed.
    DenseNet-121's 429 printed 21 MB each: the snapshot of its lowered module grew past 8 GiB and failed
    the compile, where the module without them prints 1 MB."""
    transform = {gv.name_hint for gv in mod.get_global_vars() if gv.name_hint.startswith(TRANSFORM_PARAMS)}
    if not transform:
        return mod.script()
    kept = {gv: func for gv, func in mod.functions_items() if gv.name_hint not in transform}
    shown = tvm.IRModule(kept, attrs=mod.attrs, global_infos=mod.global_infos)
    note = f"# {len(transform)} functions of the lifted weight transform ({TRANSFORM_PARAMS}_*) are not shown\n"
    return note + shown.script()


def _param_bytes(func) -> int | None:
    total = 0
    for buffer in func.params:
        shape = getattr(buffer, "shape", None)
        if shape is None:
            continue
        if not all(isinstance(d, int | tvm.tirx.IntImm) for d in shape):
            return None  # a symbolic kernel: its bytes depend on the request
        try:
            total += math.prod(int(d) for d in shape) * np.dtype(str(buffer.dtype)).itemsize
        except TypeError:  # a dtype numpy lacks (bfloat16): unknown
            return None
    return total


def kernel_nodes(stages: StageRecorder, bound: dict[str, int]) -> dict[str, list[int]]:
    """Each kernel (a fused function's name, or a kernel called as it was lowered) -> the nodes it computes,
    over all its call sites.

    ``FuseOps`` keeps the bindings' order and one fused function serves every group of the same
    structure, so each call site claims, for each kernel its function calls, a legalized binding of that
    kernel not claimed yet, and a claimed binding's node is the call site's. Which one: the call site's
    anchor (its first contraction, else its first kernel) claims the earliest; the kernels after it in
    the function claim the earliest after it, those before it the latest before it. A bias add of one
    shape ends many convs: claimed in order alone, ResNet-50's downsample conv (called before the conv
    legalized ahead of it) took that conv's add, and each kernel was traced to both convs."""
    aliased = {alias: bound[name] for alias, name in stages.aliases.items() if name in bound and alias not in bound}
    owners = binding_nodes(stages.legalized, {**bound, **aliased})
    legal = stages.legalized
    claimed = [False] * len(legal)
    found: dict[str, set[int]] = defaultdict(set)

    def claim(callee: str, near: range) -> int | None:
        position = next((i for i in near if not claimed[i] and legal[i].callee == callee), None)
        if position is None:  # not beside its anchor: the earliest anywhere
            position = next((i for i, b in enumerate(legal) if not claimed[i] and b.callee == callee), None)
        if position is not None:
            claimed[position] = True
        return position

    for call in stages.fused_main:
        if call.callee is None:
            continue
        inner = stages.fused_functions.get(call.callee)
        callees = [b.callee for b in inner if b.callee] if inner is not None else [call.callee]
        anchor = next((i for i, callee in enumerate(callees) if op_class(callee) == "contraction"), 0)
        start = claim(callees[anchor], range(len(legal)))
        if start is None:
            continue
        positions = [start]
        for step, side in ((1, callees[anchor + 1 :]), (-1, reversed(callees[:anchor]))):
            last = start
            for callee in side:
                near = range(last + 1, len(legal)) if step == 1 else range(last - 1, -1, -1)
                position = claim(callee, near)
                positions.append(position)
                last = position if position is not None else last
        found[call.callee].update(owners[p] for p in positions if p is not None and owners[p] is not None)
    return {kernel: sorted(nodes) for kernel, nodes in found.items()}


COMPUTE_OPS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm", "Einsum", "MatMulInteger", "QLinearConv"})
"""ONNX ops that hold a model's arithmetic: what every kernel map must account for."""

FILE_CAP_BYTES = 4 << 20
"""An IR or code file is cut at this size (the cut says so): a bundle is for reading, not archiving."""


def _histogram(graph) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for node in graph.node:
        counts[node.op_type] += 1
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def _write_capped(path, text: str) -> dict:
    data = text.encode()
    cut = len(data) > FILE_CAP_BYTES
    if cut:
        data = data[:FILE_CAP_BYTES] + f"\n... cut at {FILE_CAP_BYTES} of {len(data)} bytes\n".encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return {"file": str(path.relative_to(path.parents[1])), "bytes": len(text.encode()), "cut": cut}


def write_bundle(
    directory,
    *,
    source,
    specialized,
    importer,
    stages,
    executable,
    bucket,
    verify_sizes,
    code=False,
    stamp=None,
    schedules=None,
    units=None,
):
    """Write the explain bundle of one compiled bucket into ``directory`` (no weights: IR prints no
    constants' values, and the graph summaries are op counts). ``schedules``: what scheduled each
    kernel (the pipeline's record; None where no rule did); ``units``: the unit each kernel a rule ran on
    one runs on (an int8 dot product)."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    ir = {name: _write_capped(root / "ir" / f"{name}.txt", text) for name, text in stages.texts.items()}
    generated = {}
    for module in executable.mod.imports if code else []:
        kind = "cuda" if module.kind == "cuda" else "asm"
        generated[module.kind] = _write_capped(
            root / "code" / f"{module.kind}.{'cu' if kind == 'cuda' else 's'}", module.inspect_source(kind)
        )
    kernels = kernel_nodes(stages, importer.bound)
    nodes = [{"index": i, "op": op, "name": name, "inputs": inputs, "outputs": outputs}
             for i, (op, name, inputs, outputs) in enumerate(importer.converted)]  # fmt: skip
    mapped = {i for found in kernels.values() for i in found}
    flops = node_flops(specialized)
    compute = [n for n in nodes if n["op"] in COMPUTE_OPS]
    report = {
        "stamp": stamp or {},
        "bucket": {k: list(v) for k, v in bucket.items()},
        "verify_sizes": verify_sizes,
        "graph": {
            "opset": next((o.version for o in source.opset_import if o.domain in ("", "ai.onnx")), None),
            "nodes": len(source.graph.node),
            "ops": _histogram(source.graph),
            "after_specialization": {"nodes": len(specialized.graph.node), "ops": _histogram(specialized.graph)},
        },
        "nodes": nodes,
        "kernels": [
            {
                "name": name,
                "nodes": found,
                "ops": sorted({importer.converted[i][0] for i in found}),
                # A contraction's FLOPs go to the contraction kernels among those holding its node.
                "flops": sum(flops.get(nodes[i]["name"], 0) for i in found) if op_class(name) == "contraction" else 0,
                "bytes": stages.kernel_bytes.get(name),
                "schedule": (schedules or {}).get(name),
                "unit": (units or {}).get(name),
            }
            for name, found in sorted(kernels.items())
        ],
        "not_in_a_kernel": [n for n in nodes if n["index"] not in mapped],
        "unscheduled": sorted(name for name, rule in (schedules or {}).items() if rule is None),
        "compute_coverage": {"compute_nodes": len(compute), "in_a_kernel": sum(n["index"] in mapped for n in compute)},
        "ir": ir,
        "code": generated,
    }
    (root / "explain.json").write_text(json.dumps(report, indent=1))
    return report
