"""The loops a contraction plan's register tile is built in (:mod:`.contraction`): each output axis split
into its tile loops, grouped into the parallel ones and the serial ones under them, then the steps that
schedule within them (accumulate per tile, unroll and vectorize, pack a panel, place the pads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tvm import s_tir

from .base import (
    ACCUMULATOR_SCOPE,
    MAX_UNROLLED_COPIES,
    PARALLEL_MIN_MACS,
    PARALLEL_MIN_MACS_BLOCKED,
    PARALLEL_MIN_MACS_NO_REUSE,
    LoopRV,
    loop_bound,
    product_of,
    schedule_stage,
    split_symbolic,
    vectorize_tile,
)
from .gates import stages_after
from .knobs import choose
from .pads import bounded_plainly, packed_pad_row, pad_per_channel, schedule_pad_stage
from .register_tile import reduction_chunk

if TYPE_CHECKING:
    from .contraction_plan import ContractionPlan


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
        if fused is None or (loop_bound(plan.sch, fused) or 1) < 2:
            return
        if choose("contraction.parallel", product_of(info.extents) >= threshold, (True, False)):
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
