"""What every CPU rule family shares: the rule base class, loop and block
queries, vectorization helpers and the thresholds they use."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight.cpu.base import CPUScheduleRule
from tvm.target import Target

from .knobs import choose

SBlockRV = s_tir.schedule.SBlockRV
LoopRV = s_tir.schedule.LoopRV

get_sblock_realize = tvm.get_global_func("s_tir.schedule.GetSBlockRealize")
has_if_then_else = tvm.get_global_func("s_tir.schedule.HasIfThenElse")

# Work below which a loop nest stays serial: output elements (injective, row reductions, pads) and
# multiply-adds (contractions). A parallel launch costs ~3 us with two TVM threads; 64K elements copy
# in about 15. At 1M, pads and layout transforms of up to 4 MB ran serial: RegNetY-800MF 4%, DenseNet-121
# 4%, PP-OCRv4 rec 3% slower than at 64K, ResNet-50 1% faster (AMD EPYC Zen 3, AVX2).
PARALLEL_MIN_ELEMENTS = 1 << 16
PARALLEL_MIN_MACS = 1 << 22
# A contraction with output blocks beside its register rows (a channel-blocked conv over a map more than
# one pixel wide; a matmul reading column panels, panels.py): MobileNetV3-Large's 1x1 80 -> 184 conv
# on its 14x14 map (2.9M) ran on one core, and at 1M the model ran 0.94x its time at batch 1, no zoo or
# PP-OCR model slower. Not an NCHW model's convs (PP-OCR cls at batch 8: 1.07x slower at 1M), nor a conv
# over a 1x1 map (squeeze-excitation's, a matrix-vector product per image: MobileNetV3 at batch 8 1.06x
# slower). AMD EPYC Zen 3, AVX2.
PARALLEL_MIN_MACS_BLOCKED = 1 << 20
# A contraction without register reuse (depthwise conv, pooling) runs at a load per FMA, 4-8x slower a
# MAC: EfficientNet-B0 at batch 1 ran 15.0 ms with its depthwise convs parallel past 4M MACs, 13.4 past
# 1M and 13.1 past 256K (AMD EPYC Zen 3, AVX2).
PARALLEL_MIN_MACS_NO_REUSE = 1 << 18
# The scope of a tile's accumulators. TVM lowers a CPU buffer to the stack only when its scope is "global"
# and it is under 1 KB; a "local" one became a TVMBackendAllocWorkspace call and a free per tile, inside
# the parallel loop (14% of a 1x1 conv's samples). With "global", MobileNetV3-Large ran in 0.88 of its
# time at batch 1, PP-OCRv4 rec 0.90, ResNet-50 0.93 (AMD EPYC Zen 3, AVX2). A tile stays under
# STACK_BUFFER_BYTES (see VectorUnit.accumulators).
ACCUMULATOR_SCOPE = "global"
# TVM's kMaxStackAlloca: a CPU buffer of this size or more is a workspace allocation.
STACK_BUFFER_BYTES = 1024
# Register tile budget of a contraction when the tile's rows do not share vector loads
# (depthwise conv, pooling; 4 measured best). With reuse the budget is the register file's
# (see VectorUnit.accumulators).
ACCUMULATOR_VECTORS_NO_REUSE = 4
# Loop copies one unrolled tile loop nest may make: a per-channel pad tile can be a whole
# padded image (C x H rows at batch >= 2 x cores), which took LLVM minutes to compile.
MAX_UNROLLED_COPIES = 64
# Marks a loop split off a symbolic extent: LoopPartition (it runs before VectorizeLoop) peels the
# guarded last iterations off it, so the main part vectorizes without the guard.
PARTITION_HINT = "pragma_loop_partition_hint"

SymbolicBounds = dict[str, tuple[int, int]]
"""A symbolic dim's name -> the smallest and largest size its kernel serves (the dynamic tier)."""

_bounds: contextvars.ContextVar[SymbolicBounds] = contextvars.ContextVar("symbolic_bounds", default=None)


@contextlib.contextmanager
def planning_bounds(bounds: SymbolicBounds) -> Iterator[None]:
    """The symbolic dims' ranges the rules plan with while scheduling (thresholds and tile
    budgets are evaluated at the range's largest sizes)."""
    token = _bounds.set(bounds)
    try:
        yield
    finally:
        _bounds.reset(token)


class SafeRule(CPUScheduleRule):
    """A CPU rule for which any scheduling error means 'does not apply'.

    ``bounds`` are the ranges of the symbolic dims of the dynamic tier's kernels: a loop
    whose extent depends on them is planned at the range's largest size.
    """

    def __init__(self, bounds: SymbolicBounds | None = None) -> None:
        self.bounds = dict(bounds or {})

    def apply(self, func, target: Target, tunable: bool):
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        try:
            with planning_bounds(self.bounds):
                return self._schedule(func, target)
        except Exception:  # noqa: BLE001 - any failure: leave the function naive
            return None

    def _schedule(self, func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
        raise NotImplementedError


@dataclass(frozen=True)
class VectorUnit:
    """The SIMD registers a target has: their width and how many."""

    bits: int
    registers: int

    def lanes(self, dtype: str) -> int:
        return max(self.bits // tvm.DataType(dtype).bits, 1)

    @property
    def accumulators(self) -> int:
        """Accumulator vectors of a register tile whose rows share each vector load.

        The rest of the file holds the loaded vectors and the broadcast rows: 16 of 32 zmm
        on AVX-512 (measured best there while every tile was a workspace allocation); 12 of 16
        ymm on AVX2 (ONNX Runtime's MLAS runs a 6x16 float tile, 12 accumulators, on AVX2).
        And fewer than fill ``STACK_BUFFER_BYTES``: 16 zmm are exactly 1 KB, and such a tile
        would be allocated and freed at each step of the parallel loop (``ACCUMULATOR_SCOPE``),
        so AVX-512 tiles hold at most 15.
        """
        in_registers = self.registers // 2 if self.registers >= 32 else self.registers * 3 // 4
        return min(in_registers, (STACK_BUFFER_BYTES - 1) // (self.bits // 8))


def vector_unit(target: Target) -> VectorUnit:
    """The vector unit from the target's CPU features, not LLVM's vector width.

    TVM 0.27's ``llvm_get_vector_width`` answers 512 for every x86-64 CPU (``haswell`` and
    ``znver3`` too) unless the target sets ``vector-width``: AVX2 targets would plan 16-lane
    tiles on 16 ymm registers, which spill.
    """
    if target.kind.name != "llvm":
        return VectorUnit(128, 16)
    from tvm.target.codegen import llvm_cpu_has_features

    triple = str(target.attrs.get("mtriple", "") or "")
    if triple and not triple.startswith(("x86_64", "i686", "i386")):
        return VectorUnit(128, 32)  # NEON / SVE at its minimum width: 32 vector registers
    try:
        if llvm_cpu_has_features("avx512f", target):
            return VectorUnit(512, 32)
        if llvm_cpu_has_features("avx", target):
            return VectorUnit(256, 16)
    except Exception:  # noqa: BLE001 - an LLVM without the query: assume SSE
        pass
    return VectorUnit(128, 16)


def vector_lanes(target: Target, dtype: str) -> int:
    """SIMD lanes for ``dtype`` on ``target`` (16 float32 lanes with AVX-512, 8 with AVX2)."""
    return vector_unit(target).lanes(dtype)


def target_cores(target: Target) -> int:
    cores = target.attrs.get("num-cores", None)
    return int(cores) if cores else 1


def loop_extent(sch: s_tir.Schedule, loop: LoopRV) -> int | None:
    """A constant extent; ``None`` for a symbolic one."""
    value = sch.get(loop).extent
    return int(value) if isinstance(value, tirx.IntImm) else None


def extent_bound(extent) -> int | None:
    """An extent's largest value: itself when constant; for one that depends on symbolic dims, its
    largest value over their ranges (``None`` for a dim without a known range)."""
    if isinstance(extent, tirx.IntImm):
        return int(extent)
    symbols = list(vars_of(extent))
    bounds = _bounds.get() or {}
    if not symbols or any(v.name not in bounds for v in symbols):
        return None
    analyzer = tvm.sym.Analyzer()
    for var in symbols:
        low, high = bounds[var.name]
        analyzer.bind(var, tvm.ir.Range.from_min_extent(low, high - low + 1))
    largest = analyzer.const_int_bound(extent).max_value
    return int(largest) if abs(largest) < 1 << 62 else None


def loop_bound(sch: s_tir.Schedule, loop: LoopRV) -> int | None:
    """A loop's constant extent, or a symbolic one's largest value (:func:`extent_bound`)."""
    return extent_bound(sch.get(loop).extent)


def symbolic_tile(bound: int, lanes: int) -> int:
    """The vector tile of a symbolic axis whose largest extent is ``bound``: one vector, which wastes
    less on the last tile than two (rec's width 80 took 20% longer as 96 than as 5 x 16)."""
    return lanes if bound >= lanes else max(bound, 1)


def split_symbolic(sch: s_tir.Schedule, loop: LoopRV, factor: int) -> tuple[LoopRV, LoopRV]:
    """Split a symbolic loop into constant ``factor`` tiles; the tail's guard is peeled off the main
    tiles when the outer loop lowers (it must stay out of a fused loop for that)."""
    outer, inner = sch.split(loop, factors=[None, factor])
    sch.annotate(outer, PARTITION_HINT, 1)
    return outer, inner


def root_blocks(sch: s_tir.Schedule) -> list[SBlockRV]:
    return list(sch.get_child_blocks(sch.get_sblock("root")))


def block_names(sch: s_tir.Schedule) -> list[str]:
    return [sch.get(b).name_hint for b in root_blocks(sch)]


def is_spatial(sch: s_tir.Schedule, block: SBlockRV) -> bool:
    return all(iv.iter_type == tirx.IterVar.DataPar for iv in sch.get(block).iter_vars)


def trivially_bound(sch: s_tir.Schedule, block: SBlockRV) -> bool:
    """Each block iter bound to its own loop, in loop order, with the loop's extent: a constant, or
    a symbolic one with a known range."""
    loops = sch.get_loops(block)
    iter_vars = sch.get(block).iter_vars
    values = get_sblock_realize(sch, block).iter_values
    if len(loops) != len(iter_vars):
        return False
    analyzer = tvm.sym.Analyzer()
    for loop_rv, iter_var, value in zip(loops, iter_vars, values, strict=True):
        loop = sch.get(loop_rv)
        if not value.same_as(loop.loop_var) or extent_bound(loop.extent) is None:
            return False
        if not analyzer.can_prove_equal(iter_var.dom.extent, loop.extent):
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


def whole_vector_tile(extent: int, lanes: int) -> int | None:
    """The vector tile a contraction's vectorized axis of ``extent`` gets without padding: two
    vectors, one, or half of one; ``None`` when none divides it (the rule then pads the axis)."""
    return pick_factor(extent, [lanes * 2, lanes, lanes // 2])


def total_elements(sch: s_tir.Schedule, block: SBlockRV) -> int:
    """The iterations of a block's loop nest (at the symbolic dims' largest sizes)."""
    return product_of(loop_bound(sch, loop) or 1 for loop in sch.get_loops(block))


def vectorize_innermost(sch: s_tir.Schedule, block: SBlockRV, lanes: int, parallel: bool) -> None:
    """A spatial loop nest: vectorize (part of) the innermost loop, fuse the rest, maybe parallel."""
    loops = sch.get_loops(block)
    if not loops or any(loop_bound(sch, loop) is None for loop in loops):
        return
    outer, inner = list(loops[:-1]), loops[-1]
    innermost = loop_extent(sch, inner)
    if innermost is None:  # symbolic: whole vectors, the tail peeled off (its loop stays out of the fusion)
        factor = symbolic_tile(loop_bound(sch, inner) or lanes, lanes)
        _, inner = split_symbolic(sch, inner, factor)
    else:
        # A power-of-two divisor of the lanes' multiples; else a short loop whole; else scalar.
        factor = pick_factor(innermost, [lanes * 2, lanes, lanes // 2, lanes // 4])
        if factor is None or factor < 4:
            factor = innermost if innermost <= lanes * 4 else (factor or 1)
        if 1 < factor < innermost:
            split_outer, inner = sch.split(inner, factors=[None, factor])
            outer.append(split_outer)
    if factor > 1:
        sch.vectorize(inner)
    if outer:
        fused = sch.fuse(*outer) if len(outer) > 1 else outer[0]
        if parallel:
            sch.parallel(fused)


def schedule_stage(sch: s_tir.Schedule, block: SBlockRV, target: Target) -> None:
    """A root-level spatial block on its own: vectorized in its dtype's lanes, parallel where large."""
    lanes = vector_lanes(target, str(sch.get(block).writes[0].source.dtype))
    parallel = choose("stage.parallel", total_elements(sch, block) >= PARALLEL_MIN_ELEMENTS, (True, False))
    vectorize_innermost(sch, block, lanes, bool(parallel))


# A root-block annotation: the unit a kernel's arithmetic runs on, where a rule chose one (an int8 dot
# product); the explain report names it beside the kernel's time.
UNIT_ANNOTATION = "jitserve_unit"


# A block annotation: the block is a stage of its own, computed once, never inlined into its consumers (a
# resize's first pass, see resize.py; the multiply that broadcasts a squeeze-excitation gate, gates.py).
STAGE_ANNOTATION = "jitserve_stage"


# Inlining copies a producer's expression once for each load of it in its consumer, and the polynomial
# math (math.py) loads its argument 5 to 7 times: Add -> Erf -> Mul -> Sigmoid -> Exp inlined into one
# expression of 1.5 MB, which LLVM took 15-20 s to compile. Past this many nodes copied, the producer
# stays a stage of its own (one more pass over memory).
MAX_INLINE_COPIED_NODES = 256


def inline_injective(sch: s_tir.Schedule, keep: set[str] | None = None, bounded: bool = False) -> None:
    """Inline every spatial block that can be (except ``keep`` and stages): into consumers, then producers.
    ``bounded``: not where that copies more than ``MAX_INLINE_COPIED_NODES`` nodes."""
    keep = keep or set()
    changed = True
    while changed:
        changed = False
        for inline in (sch.compute_inline, sch.reverse_compute_inline):
            for block in root_blocks(sch):
                stmt = sch.get(block)
                if stmt.name_hint in keep or STAGE_ANNOTATION in stmt.annotations or not is_spatial(sch, block):
                    continue
                if bounded and _copied_nodes(sch, block, inline == sch.compute_inline) > MAX_INLINE_COPIED_NODES:
                    continue
                try:
                    inline(block)
                except Exception:  # noqa: BLE001 - not inlinable: try the next block
                    continue
                changed = True
                break
            if changed:
                break


def _copied_nodes(sch: s_tir.Schedule, block: SBlockRV, into_consumers: bool) -> int:
    """How many expression nodes inlining ``block`` copies: the producer's expression once for each load of
    it past the first (into its consumers, or its producer's into it)."""
    pairs = (
        [(block, consumer) for consumer in sch.get_consumers(block)]
        if into_consumers
        else [(producer, block) for producer in sch.get_producers(block)]
    )
    copied = 0
    for producer, consumer in pairs:
        store, reader = sch.get(producer).body, sch.get(consumer).body
        if not isinstance(store, tirx.BufferStore) or not isinstance(reader, tirx.BufferStore):
            continue
        loads = sum(
            isinstance(node, tvm.ir.TensorLoad) and node.source.same_as(store.buffer) for node in _nodes(reader.value)
        )
        copied += max(loads - 1, 0) * sum(1 for _ in _nodes(store.value))
    return copied


def _nodes(expr) -> Iterator:
    """The float nodes of an expression tree, loads as leaves: the arithmetic an inlining copies (index and
    condition arithmetic is integer and shared). A node shared by two parents counts twice, as code does."""
    yield expr
    if isinstance(expr, tvm.ir.TensorLoad):
        return
    if isinstance(expr, tvm.ir.Call):
        children = expr.args
    elif isinstance(expr, tirx.Select):
        children = (expr.true_value, expr.false_value)
    elif isinstance(expr, tirx.Cast):
        children = (expr.value,)
    else:  # binary operators have two operands; leaves none
        children = [child for child in (getattr(expr, "a", None), getattr(expr, "b", None)) if child is not None]
    for child in children:
        if str(child.ty).startswith("float"):
            yield from _nodes(child)


def vectorize_tile(
    sch: s_tir.Schedule,
    block: SBlockRV,
    tile: LoopRV | None,
    lanes: int | None = None,
    max_copies: int = MAX_UNROLLED_COPIES,
) -> None:
    """The loops of ``block`` under ``tile``: vectorize the innermost, unroll the others. A symbolic
    innermost loop (a per-channel pad of a symbolic width) is vectorized in ``lanes``, its tail peeled."""
    loops = sch.get_loops(block)
    if tile is not None:
        loops = loops[loop_depth(sch, tile) :]
    if loops and lanes and loop_extent(sch, loops[-1]) is None and loop_bound(sch, loops[-1]) is not None:
        sch.vectorize(split_symbolic(sch, loops[-1], lanes)[1])
    elif loops and (loop_extent(sch, loops[-1]) or 1) > 1:
        sch.vectorize(loops[-1])
    # Unroll from the inside out while the copies stay few: a tile can be a whole padded image.
    copies = 1
    for loop in reversed(loops[:-1]):
        extent = loop_extent(sch, loop) or 1
        if extent > 1:
            if copies * extent > max_copies:
                break
            sch.unroll(loop)
            copies *= extent
