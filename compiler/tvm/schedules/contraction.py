"""Contractions: matmul, batch matmul, conv2d (incl. depthwise and padded) and
pooling, each with its fused producers and epilogue, tiled into registers,
vectorized and run in parallel when large.

The rule is a sequence of named steps over one :class:`ContractionPlan`: what
``contraction_analysis`` reads off the block, then the choices (tiles, a packed
panel, where the pad is computed) and the schedule primitives that carry them out.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from tvm import s_tir

from .base import (
    ACCUMULATOR_SCOPE,
    MAX_UNROLLED_COPIES,
    PARALLEL_MIN_MACS,
    PARALLEL_MIN_MACS_BLOCKED,
    PARALLEL_MIN_MACS_NO_REUSE,
    LoopRV,
    SafeRule,
    SBlockRV,
    VectorUnit,
    block_names,
    has_if_then_else,
    inline_injective,
    is_spatial,
    loop_bound,
    product_of,
    root_blocks,
    schedule_stage,
    split_symbolic,
    target_cores,
    total_elements,
    vector_unit,
    vectorize_tile,
    whole_vector_tile,
)
from .contraction_analysis import main_contraction, plain_iters
from .flat_map import flatten_pointwise_map
from .gates import epilogues, mark_broadcast, stages_after
from .groups import split_group_blocks
from .pads import bounded_plainly, packed_pad_row, pad_per_channel, schedule_pad_stage
from .panel import packable_operand, panel_axes
from .register_tile import (
    ContractionInfo,
    outer_tile,
    padded_rows,
    ragged_outer_tile,
    reduction_chunk,
    tile_sizes,
)

# A depthwise conv's or pool's padded map per channel block past which its pad is computed per output
# row instead: half of a 512 KB L2 (EfficientNet's 32-channel 112x112 depthwise conv, 416 KB a block:
# 0.125 -> 0.086 ms per row; 108 KB ones ran 10-25% slower per row; AMD EPYC Zen 3, AVX2).
PER_CHANNEL_PAD_BYTES = 256 * 1024


class Contraction(SafeRule):
    """One reduction block whose innermost output axis can be vectorized: matmul,
    batch matmul, conv2d (incl. depthwise), pooling -- with fused producers and epilogue.

    The innermost output axis is vectorized (a power-of-two number of vectors; a
    matmul whose axis has no such divisor is computed on a padded extent). An
    output axis the vector-loaded operand does not depend on (matmul rows, conv
    output channels) is register-blocked and unrolled, so each vector load feeds
    several FMAs. The reduction loops sit outside that register tile, which
    accumulates in a local buffer; the epilogue is computed per tile straight
    from it. A channel-blocked conv whose tile's weights outgrow L1 takes the
    reduction in chunks instead, each shared by a row of tiles (see
    ``register_tile.reduction_chunk``). The outer tiles are fused and run in
    parallel. Plain-copy producers are inlined; a padding producer is computed
    per channel inside the parallel loop (depthwise conv, pooling; per output
    row too where the channel blocks are few or a block's map is large) or once
    up front, split into a zero fill and a vectorized copy of the interior.

    A symbolic extent (the dynamic tier) is tiled as a constant one of the
    range's largest size would be; its tiles' loop stays serial under the
    parallel one, so that the last, guarded tile is peeled off when it lowers.
    """

    def _schedule(self, func, target):
        # Padding the computation is the least proven step: retry without it.
        for allow_pad in (True, False):
            try:
                sch = self._try(func, target, allow_pad)
            except Exception:  # noqa: BLE001
                sch = None
            if sch is not None:
                return sch
        return None

    def _try(self, func, target, allow_pad: bool):
        sch = s_tir.Schedule(func)
        reductions = [b for b in root_blocks(sch) if not is_spatial(sch, b)]
        if len(reductions) != 1:
            return None
        main_name = sch.get(reductions[0]).name_hint
        padded = inline_producers(sch, main_name)
        split_group_blocks(sch, main_name, PER_CHANNEL_PAD_BYTES)
        plan = ContractionPlan.analyze(sch, main_name, padded, target)
        if plan is None or (allow_pad and not plan.pad_to_whole_tiles()):
            return None
        plan.find_neighbours()
        plan.choose_tiles()
        plan.choose_panel()
        plan.choose_pad_placement()
        nest = LoopNest.build(plan)
        nest.parallelize()
        nest.accumulate_per_tile()
        nest.unroll_and_vectorize()
        nest.pack_panel()
        return nest.place_pads()


def inline_producers(sch: s_tir.Schedule, main_name: str) -> bool:
    """Plain-copy producers and injective stages inlined (a pad and a broadcast gate stay stages);
    whether the contraction reads a pad."""
    for name in block_names(sch):
        if name == main_name:
            break
        if not has_if_then_else(sch.get(sch.get_sblock(name))):  # a pad stays a stage
            with contextlib.suppress(Exception):
                sch.compute_inline(sch.get_sblock(name))
    names = block_names(sch)
    gate = mark_broadcast(sch, main_name)
    inline_injective(sch, keep=set(names[: names.index(main_name)]) | ({gate} if gate else set()))
    return any(has_if_then_else(sch.get(sch.get_sblock(name))) for name in names[: names.index(main_name)])


@dataclass
class ContractionPlan:
    """One contraction block being scheduled: its analysis and the choices each step makes."""

    sch: s_tir.Schedule
    target: object
    main_name: str
    padded: bool
    unit: VectorUnit
    lanes: int
    main: SBlockRV
    info: ContractionInfo
    producers: list[str] = field(default_factory=list)
    after: list[str] = field(default_factory=list)
    mr: int = 1
    nr: int = 1
    ov: int = 1
    partial: tuple[int, int] | None = None
    packed: str | None = None
    panel_iters: list[int] = field(default_factory=list)
    per_channel: list[int] = field(default_factory=list)
    pad_rows: bool = False

    @classmethod
    def analyze(cls, sch: s_tir.Schedule, main_name: str, padded: bool, target) -> ContractionPlan | None:
        """The block's analysis, after a pointwise map is flattened into one axis where that pays."""
        found = main_contraction(sch, main_name, padded)
        if found is None:
            return None
        main, info = found
        unit = vector_unit(target)
        lanes = unit.lanes(str(sch.get(main).writes[0].source.dtype))
        plan = cls(sch, target, main_name, padded, unit, lanes, main, info)
        if flatten_pointwise_map(sch, main, info, lanes, unit) and not plan._reanalyze():
            return None
        return plan

    def _reanalyze(self) -> bool:
        found = main_contraction(self.sch, self.main_name, self.padded)
        if found is None:
            return False
        self.main, self.info = found
        return True

    def pad_to_whole_tiles(self) -> bool:
        """The computation padded to whole vectors and tiles where its extents are ragged or symbolic;
        False where the padded block no longer analyzes."""
        info, lanes, unit = self.info, self.lanes, self.unit
        n = info.extents[info.vec]
        # A symbolic axis of a matmul is padded to whole tiles too: a guard inside the accumulation ran
        # the last tile scalar (rec's 12 rows at width 100 in a 16-row tile: 0.69 against 0.29 ms).
        symbolic_vec = info.vec in info.symbolic
        symbolic_reg = info.reg is not None and info.reg in info.symbolic
        ragged = not symbolic_vec and n > lanes and whole_vector_tile(n, lanes) is None
        rows = padded_rows(info, lanes, unit.accumulators)
        if not (symbolic_vec or symbolic_reg or ragged or rows):
            return True
        mr, nr = tile_sizes(info, lanes, unit.accumulators)
        padding = [1] * len(info.extents)
        padding[info.vec] = nr if symbolic_vec else lanes if ragged else 1
        if symbolic_reg or rows:
            padding[info.reg] = rows or mr
        self.sch.pad_einsum(self.main, padding)
        after = epilogues(self.sch, self.main_name)
        if len(after) > 1:  # the copy out of the padded result, then the epilogue
            self.sch.compute_inline(self.sch.get_sblock(after[0]))
        return self._reanalyze()

    def find_neighbours(self) -> None:
        """The stages before the contraction (pads) and its epilogue, as they stand now."""
        names = block_names(self.sch)
        self.producers = names[: names.index(self.main_name)]
        self.after = epilogues(self.sch, self.main_name)

    def choose_tiles(self) -> None:
        """The register tile (``mr`` x ``nr``), the tiles along the outer axis (``ov``) and whether the
        last of them is partial."""
        info, lanes, unit = self.info, self.lanes, self.unit
        mr, self.nr = tile_sizes(info, lanes, unit.accumulators)
        self.ov, self.mr = outer_tile(info, lanes, self.nr, mr, unit)
        # A tile whose last one is partial, not for a conv over its input as it is (ConvNeXt's 2x2
        # stride-2 384 -> 768 one onto a 7x7 map ran 1.09-1.28x the time of 1 x 7 so; AMD EPYC Zen 3, AVX2).
        self.partial = ragged_outer_tile(info, lanes, self.nr, unit) if info.exact_width else None
        if self.partial is not None:
            self.ov, self.mr = self.partial

    def choose_panel(self) -> None:
        """A weight panel (A @ B: B's K x nr columns) packed once per column tile, reused by every row tile."""
        sch, info = self.sch, self.info
        if not info.symbolic and self.ov == 1:  # a padded matmul's producers pad its rows, not the panel's operand
            packed = packable_operand(sch, self.main, info, self.mr, self.nr, cores=target_cores(self.target))
            produced = {sch.get(sch.get_sblock(name)).writes[0].source.name for name in self.producers}
            self.packed = None if packed in produced else packed
        if self.packed is not None:
            self.panel_iters = panel_axes(sch.get(self.main), info, self.packed)

    def choose_pad_placement(self) -> None:
        """A single pad indexed by plain (batch, channel) axes is computed per channel (not a padded
        matmul's rows: its column tiles are the parallel loop), and per output row too where that pays."""
        sch, info = self.sch, self.info
        if len(self.producers) != 1 or self.packed is not None:
            return
        tiled = (info.vec, info.reg, info.outer)
        indexing_plainly = plain_iters(sch, self.main, self.producers[0], info)
        plain = [p for p in indexing_plainly if p not in tiled]
        shares = product_of(info.extents[p] for p in plain)
        # Per block of channel lanes (the vector indexes the pad plainly); NCHW pads one channel at a time.
        blocks = info.vec in indexing_plainly
        pad_bytes = total_elements(sch, sch.get_sblock(self.producers[0])) * 4 // max(1, shares) if blocks else 0
        # Not for a partial tile (its loop is chunked): with the pad per image and the chunked tiles
        # under it, ResNet-50 at batch 8 ran 1.10x the time of the build before; with the pad up
        # front, as at batch 1, 1.01x (AMD EPYC Zen 3, AVX2).
        cores = target_cores(self.target)
        if plain and shares >= 2 * cores and pad_bytes <= PER_CHANNEL_PAD_BYTES and not self.partial:
            self.per_channel = plain
        elif len(plain) >= 2:
            # A depthwise conv (or pool) with too few channel blocks to share out, or whose padded map
            # per channel block outgrows L2 (MobileNetV3's 16-channel 112x112 one: its pad was one serial
            # pass over the map, 4.9x ONNX Runtime's time): the pad is computed per output row too, as
            # the rows of taps that row reads.
            rows = [p for p in info.spatial if p not in tiled and p not in plain and info.extents[p] > 1]
            self.per_channel = plain + rows[:1] if rows else []
            self.pad_rows = bool(rows)


@dataclass
class LoopNest:
    """The loops built around a plan's register tile, and the steps that schedule within them."""

    plan: ContractionPlan
    loops: list[LoopRV]
    """The block's loops before any split, by iter (the ones left unsplit are still these)."""
    first: list[LoopRV]
    """Fused into one loop, run in parallel when large."""
    second: list[LoopRV]
    """Serial tile loops under it (per-channel pads; the rows of a packed panel)."""
    fused: LoopRV | None
    tile: LoopRV | None
    """The loop one tile's accumulators, epilogue and init live under."""
    reduce_loops: list[LoopRV]
    outer_inner: LoopRV | None
    reg_inner: LoopRV | None
    vec_inner: LoopRV | None
    reg_outer: LoopRV | None
    row_copies: int
    """Copies an unrolled init or epilogue may have."""

    @classmethod
    def build(cls, plan: ContractionPlan) -> LoopNest:
        """Each output axis split into its tile loops, grouped into the parallel ones and the serial
        ones under them, with the reduction outside the register tile (or a chunk of it outside a row
        of tiles, where the weights of a tile outgrow L1)."""
        sch, info, nr, mr, ov = plan.sch, plan.info, plan.nr, plan.mr, plan.ov
        loops = sch.get_loops(plan.main)
        first: list[LoopRV] = []
        second: list[LoopRV] = []
        reg_inner = vec_inner = outer_inner = reg_outer = None
        for pos in info.spatial:
            loop = loops[pos]
            if plan.per_channel:
                group = first if pos in plan.per_channel else second
            else:
                group = second if (plan.packed is not None and pos not in plan.panel_iters) else first
            symbolic = pos in info.symbolic
            split = split_symbolic if symbolic else _split_tile
            if symbolic and pos in (info.vec, info.reg):
                group = second  # a peeled loop cannot be part of the fused parallel one
            if pos == info.vec:
                if nr < info.extents[pos] or symbolic:
                    loop, vec_inner = split(sch, loop, nr)
                    group.append(loop)
                else:
                    vec_inner = loop
            elif pos == info.outer and ov > 1:
                loop, outer_inner = _split_tile(sch, loop, ov)
                group.append(loop)
            elif pos == info.reg and (mr > 1 or symbolic):
                if mr < info.extents[pos] or symbolic:
                    loop, reg_inner = split(sch, loop, mr)
                    group.append(loop)
                    reg_outer = loop
                else:
                    reg_inner = loop
            else:
                group.append(loop)
        reduce_loops = [loops[p] for p in info.reduce]
        inner = [x for x in (outer_inner, reg_inner, vec_inner) if x is not None]
        row_copies = MAX_UNROLLED_COPIES
        # A weight slice too large for L1: the tile's columns move inside a chunk of the reduction.
        # A partial tile's loop always moves so (``ragged_outer_tile``): the last tile is peeled off it later.
        chunked = ov > 1 and (plan.partial is not None or reg_outer in first)
        chunk = reduction_chunk(info, ov, plan.lanes) if chunked else None
        if chunk is not None:
            (first if reg_outer in first else second).remove(reg_outer)
            head = reduce_loops[0]
            if chunk < info.extents[info.reduce[0]]:
                head, chunk_loop = sch.split(head, factors=[None, chunk])
                rest = [chunk_loop, *reduce_loops[1:]]
            else:
                rest = reduce_loops[1:]
            sch.reorder(*first, *second, head, reg_outer, *rest, *inner)
            reduce_loops = [head]
            row_copies = ov * mr  # the init and epilogue of a row of tiles: unrolled one tile at a time
        else:
            sch.reorder(*first, *second, *reduce_loops, *inner)
        fused = sch.fuse(*first) if len(first) > 1 else (first[0] if first else None)
        tile = second[-1] if second else fused
        return cls(
            plan, loops, first, second, fused, tile, reduce_loops,
            outer_inner, reg_inner, vec_inner, reg_outer, row_copies,
        )  # fmt: skip

    def parallelize(self) -> None:
        """The fused loop in parallel, where the work is large enough to share out."""
        plan = self.plan
        info = plan.info
        threshold = PARALLEL_MIN_MACS if info.reuse else PARALLEL_MIN_MACS_NO_REUSE
        if info.outer is not None and info.reg is not None and info.extents[info.reg] > 1:
            threshold = min(threshold, PARALLEL_MIN_MACS_BLOCKED)
        fused = self.fused
        if fused is not None and product_of(info.extents) >= threshold and (loop_bound(plan.sch, fused) or 1) >= 2:
            plan.sch.parallel(fused)

    def accumulate_per_tile(self) -> None:
        """The tile accumulates in its own buffer (on the stack); the epilogue (or a write-back) reads it
        per tile."""
        plan = self.plan
        sch, info, nr = plan.sch, plan.info, plan.nr
        if plan.after:
            epilogue = sch.get_sblock(plan.after[0])
            sch.set_scope(plan.main, 0, ACCUMULATOR_SCOPE)
        else:
            epilogue = sch.cache_write(plan.main, 0, ACCUMULATOR_SCOPE)
        if self.tile is not None:
            sch.reverse_compute_at(epilogue, self.tile, preserve_unit_loops=True)
            vectorize_tile(sch, epilogue, self.tile, max_copies=self.row_copies)
        for name in stages_after(sch, plan.main_name):  # a broadcast of the result (gates.py)
            schedule_stage(sch, sch.get_sblock(name), plan.target)
        if info.vec in info.symbolic and info.multiple.get(info.vec, 1) > 1 and info.multiple[info.vec] % nr:
            # A k * W width (a detector's level, not padded: see legalize.py) whose last tile may be a guarded
            # tail: its accumulators are indexed within the tile, or the guard keeps the local buffer from
            # being compacted (a whole row of them in memory: 2.5x).
            position = info.spatial.index(info.vec)
            sch.transform_layout(
                plan.main,
                ("write", 0),
                lambda *dims: [d % nr if i == position else d for i, d in enumerate(dims)],
                assume_injective_transform=True,
            )

    def unroll_and_vectorize(self) -> None:
        """The register tile unrolled and its columns vectorized, the init split off, and the last,
        partial tile peeled off."""
        plan = self.plan
        sch = plan.sch
        # Loop kinds before decompose_reduction: the update block stops being a complete
        # reduction block once its init is split off, and vectorize checks that.
        for inner in (self.outer_inner, self.reg_inner):
            if inner is not None:
                sch.unroll(inner)
        if plan.nr > 1:
            sch.vectorize(self.vec_inner)
        init = sch.decompose_reduction(plan.main, self.reduce_loops[0])
        vectorize_tile(sch, init, self.tile, max_copies=self.row_copies)
        if plan.partial is not None:
            # The whole tiles, then the last, partial one: each loop's bounds decide its guard (true, or a
            # constant per unrolled column), so no tile tests a column inside the accumulation. The init
            # keeps its guard: a store per column a row.
            sch.loop_partition(self.reg_outer, [plan.info.extents[plan.info.reg] // plan.mr, None])

    def pack_panel(self) -> None:
        """The packed operand's panel copied once per column tile."""
        plan = self.plan
        if plan.packed is None:
            return
        sch = plan.sch
        reads = [r.source.name for r in sch.get(plan.main).reads]
        # On the stack: a workspace allocation per panel left the pool holding memory after a
        # model's delete (+14 MB in the release test); packable_operand caps the panel's size.
        panel = sch.cache_read(plan.main, reads.index(plan.packed), "local")
        sch.compute_at(panel, self.fused, preserve_unit_loops=True)
        vectorize_tile(sch, panel, self.fused)

    def place_pads(self) -> s_tir.Schedule:
        """The pad inside the loop nest: per channel (and row) under the parallel loop, or a packed conv's
        under its row loop; else once up front. The schedule that results."""
        plan = self.plan
        sch, lanes = plan.sch, plan.lanes
        pad_at, decompose = (self.fused, not plan.pad_rows) if plan.per_channel else (None, False)
        if plan.packed is not None:  # never per channel
            pad_at = packed_pad_row(sch, plan.info, plan.producers, self.second, self.loops)
        for name in plan.producers:
            if pad_at is None:
                schedule_pad_stage(sch, sch.get_sblock(name), lanes)
                continue
            # On a copy: decompose_padding refuses a pad read with a stride (a strided 1x1 conv, as in
            # ResNet's downsample shortcut), and the pad is then computed once up front instead.
            trial = sch.copy()
            try:
                pad_per_channel(trial, trial.get_sblock(name), pad_at, lanes, decompose=decompose)
            except s_tir.schedule.ScheduleError:
                schedule_pad_stage(sch, sch.get_sblock(name), lanes)
                continue
            if bounded_plainly(trial, name):
                sch = trial
            else:
                schedule_pad_stage(sch, sch.get_sblock(name), lanes)
        return sch


def _split_tile(sch: s_tir.Schedule, loop: LoopRV, factor: int) -> tuple[LoopRV, LoopRV]:
    outer, inner = sch.split(loop, factors=[None, factor])
    return outer, inner
