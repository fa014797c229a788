"""What every CPU rule family shares: the rule base class, loop and block
queries, vectorization helpers and the thresholds they use."""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight.cpu.base import CPUScheduleRule
from tvm.target import Target

SBlockRV = s_tir.schedule.SBlockRV
LoopRV = s_tir.schedule.LoopRV

get_sblock_realize = tvm.get_global_func("s_tir.schedule.GetSBlockRealize")
has_if_then_else = tvm.get_global_func("s_tir.schedule.HasIfThenElse")

# Work below which a loop nest stays serial: output elements (injective, row reductions) and
# multiply-adds (contractions). A parallel launch costs ~3 us with two TVM threads.
PARALLEL_MIN_ELEMENTS = 1 << 20
PARALLEL_MIN_MACS = 1 << 22
# Register tile budget of a contraction, in accumulator vectors: when the tile's rows share each
# vector load (matmul, conv), and when they do not (depthwise conv, pooling; 4 measured best).
ACCUMULATOR_VECTORS = 16
ACCUMULATOR_VECTORS_NO_REUSE = 4
# Loop copies one unrolled tile loop nest may make: a per-channel pad tile can be a whole
# padded image (C x H rows at batch >= 2 x cores), which took LLVM minutes to compile.
MAX_UNROLLED_COPIES = 64


class SafeRule(CPUScheduleRule):
    """A CPU rule for which any scheduling error means 'does not apply'."""

    def apply(self, func, target: Target, tunable: bool):
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        try:
            return self._schedule(func, target)
        except Exception:  # noqa: BLE001 - any failure: leave the function naive
            return None

    def _schedule(self, func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
        raise NotImplementedError


def vector_lanes(target: Target, dtype: str) -> int:
    """SIMD lanes for ``dtype`` on ``target`` (16 float32 lanes with AVX-512)."""
    try:
        from tvm.target.codegen import llvm_get_vector_width

        bits = int(llvm_get_vector_width(target))
    except Exception:  # noqa: BLE001 - an LLVM without the query: assume SSE
        bits = 128
    return max((bits if bits > 0 else 128) // tvm.DataType(dtype).bits, 1)


def target_cores(target: Target) -> int:
    cores = target.attrs.get("num-cores", None)
    return int(cores) if cores else 1


def loop_extent(sch: s_tir.Schedule, loop: LoopRV) -> int | None:
    value = sch.get(loop).extent
    return int(value) if isinstance(value, tirx.IntImm) else None


def root_blocks(sch: s_tir.Schedule) -> list[SBlockRV]:
    return list(sch.get_child_blocks(sch.get_sblock("root")))


def block_names(sch: s_tir.Schedule) -> list[str]:
    return [sch.get(b).name_hint for b in root_blocks(sch)]


def is_spatial(sch: s_tir.Schedule, block: SBlockRV) -> bool:
    return all(iv.iter_type == tirx.IterVar.DataPar for iv in sch.get(block).iter_vars)


def trivially_bound(sch: s_tir.Schedule, block: SBlockRV) -> bool:
    """Each block iter bound to its own loop, in loop order, with the loop's constant extent."""
    loops = sch.get_loops(block)
    iter_vars = sch.get(block).iter_vars
    values = get_sblock_realize(sch, block).iter_values
    if len(loops) != len(iter_vars):
        return False
    for loop_rv, iter_var, value in zip(loops, iter_vars, values, strict=True):
        loop = sch.get(loop_rv)
        if not value.same_as(loop.loop_var) or not isinstance(loop.extent, tirx.IntImm):
            return False
        if not isinstance(iter_var.dom.extent, tirx.IntImm) or int(iter_var.dom.extent) != int(loop.extent):
            return False
    return True


def vars_of(expr) -> set:
    return set(tirx.analysis.undefined_vars(expr))


def product_of(values) -> int:
    total = 1
    for value in values:
        total *= int(value)
    return total


def loop_depth(sch: s_tir.Schedule, loop: LoopRV) -> int:
    """The number of loops from the root down to ``loop``, itself included."""
    depth = 0
    sref = sch.get_sref(loop)
    while sref is not None and isinstance(sref.stmt, tirx.For):
        depth += 1
        sref = sref.parent
    return depth


def pick_factor(extent: int, candidates: list[int]) -> int | None:
    """The first candidate that divides ``extent``."""
    return next((f for f in candidates if 0 < f <= extent and extent % f == 0), None)


def total_elements(sch: s_tir.Schedule, block: SBlockRV) -> int:
    return product_of(loop_extent(sch, loop) or 1 for loop in sch.get_loops(block))


def vectorize_innermost(sch: s_tir.Schedule, block: SBlockRV, lanes: int, parallel: bool) -> None:
    """A spatial loop nest: vectorize (part of) the innermost loop, fuse the rest, maybe parallel."""
    loops = sch.get_loops(block)
    extents = [loop_extent(sch, loop) for loop in loops]
    if not loops or any(e is None for e in extents):
        return
    # A power-of-two divisor of the lanes' multiples; else a short loop whole; else scalar.
    factor = pick_factor(extents[-1], [lanes * 2, lanes, lanes // 2, lanes // 4])
    if factor is None or factor < 4:
        factor = extents[-1] if extents[-1] <= lanes * 4 else (factor or 1)
    outer, inner = list(loops[:-1]), loops[-1]
    if 1 < factor < extents[-1]:
        split_outer, inner = sch.split(inner, factors=[None, factor])
        outer.append(split_outer)
    if factor > 1:
        sch.vectorize(inner)
    if outer:
        fused = sch.fuse(*outer) if len(outer) > 1 else outer[0]
        if parallel:
            sch.parallel(fused)


def inline_injective(sch: s_tir.Schedule, keep: set[str] | None = None) -> None:
    """Inline every spatial block that can be (except ``keep``): into consumers, then producers."""
    keep = keep or set()
    changed = True
    while changed:
        changed = False
        for inline in (sch.compute_inline, sch.reverse_compute_inline):
            for block in root_blocks(sch):
                if sch.get(block).name_hint in keep or not is_spatial(sch, block):
                    continue
                try:
                    inline(block)
                except Exception:  # noqa: BLE001 - not inlinable: try the next block
                    continue
                changed = True
                break
            if changed:
                break
