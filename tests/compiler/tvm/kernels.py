"""One kernel of a model, through the compile's stages for a target and scheduled by one rule: its schedule
and its assembly, for tests of the code a CPU's unit gets (built, never run: the target need not be this CPU);
and a model compiled with its weights as parameters, as the server compiles it."""

from __future__ import annotations

from pathlib import Path

import onnx
import tvm

from compiler.models.weights import load_weights, save_prepared
from compiler.running.engines import TvmEngine
from compiler.tvm.build import compile_relax, import_relax
from compiler.tvm.main_rewrite import with_integer_weights
from compiler.tvm.pipeline import tuned_module_stages
from compiler.tvm.prepare import split_weights


def scheduled_kernel(mod: tvm.IRModule, target: tvm.target.Target, name: str, rule):
    """The one kernel of ``mod`` whose name has ``name`` (and not ``panels``: a weight transform), staged for
    ``target`` and scheduled by ``rule``: (the schedule, or None where the rule declined; its assembly)."""
    with target:
        for _, passes in tuned_module_stages(target):
            mod = tvm.transform.Sequential(passes)(mod)
    kernels = [f for gv, f in mod.functions_items() if name in gv.name_hint and "panels" not in gv.name_hint]
    assert len(kernels) == 1, [gv.name_hint for gv in mod.get_global_vars()]
    sch = rule().apply(kernels[0], target, False)
    if sch is None:
        return None, ""
    lib = tvm.tirx.build(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), target)
    return sch, lib.inspect_source("asm")


def instruction_lines(asm: str, instruction: str) -> list[str]:
    """The lines of ``asm`` that run ``instruction`` (AVX-VNNI's are written ``{vex} vpdpbusd``)."""
    lines = [[word for word in line.split() if word != "{vex}"] for line in asm.splitlines()]
    return [" ".join(words) for words in lines if words and words[0] == instruction]


def compiled_with_weight_parameters(model: onnx.ModelProto, bucket: dict, dtypes: dict, target: dict, directory: Path):
    """``model`` compiled as the server compiles it: its weights (int8 ones too) split off into parameters,
    their values handed to the compile (:func:`compiler.tvm.main_rewrite.with_integer_weights`). Returns
    the engine running it on those weights, what the compile observed, the library's bytes and the weights."""
    graph, weights = split_weights(model)
    save_prepared(directory / "prepared", graph, weights)
    weights = load_weights(directory / "prepared")  # mapped and aligned, as the server maps them
    mod = with_integer_weights(import_relax(graph, bucket, dtypes), weights)
    observed: dict = {}
    library = directory / "kernel.so"
    compile_relax(mod, target, observed=observed).export_library(str(library))
    outputs = [value.name for value in graph.graph.output]
    engine = TvmEngine(library, list(bucket), outputs, weights=list(weights.values()))
    return engine, observed, library.read_bytes(), weights
