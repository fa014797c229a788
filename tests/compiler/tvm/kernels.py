"""One kernel of a model, through the compile's stages for a target and scheduled by one rule: its schedule
and its assembly, for tests of the code a CPU's unit gets (built, never run: the target need not be this CPU)."""

from __future__ import annotations

import tvm

from compiler.tvm.pipeline import tuned_module_stages


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
