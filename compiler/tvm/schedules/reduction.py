"""Row reductions: softmax, layer norm, mean / global pooling, GEMV: blocks
that share leading (row) axes, computed row by row; and a reduction of a whole
tensor to one value."""

from __future__ import annotations

import contextlib

import tvm
from tvm import s_tir, tirx

from .base import (
    PARALLEL_MIN_ELEMENTS,
    LoopRV,
    SafeRule,
    SBlockRV,
    extent_bound,
    get_sblock_realize,
    has_if_then_else,
    is_spatial,
    loop_bound,
    loop_depth,
    loop_extent,
    pick_factor,
    root_blocks,
    split_symbolic,
    total_elements,
    trivially_bound,
    vars_of,
    vector_lanes,
)
from .knobs import choose

WHOLE_VECTORS_MIN = 8
"""A row at least this many vectors long that no whole vector divides is computed in whole vectors, then
its tail in a loop of its own, not in the part vectors that divide it."""


class RowReduction(SafeRule):
    """Blocks sharing leading spatial (row) axes, at least one a reduction: softmax,
    layer norm, mean / global pooling, GEMV with its epilogue.

    Rows are fused (parallel when large) and every block is computed per row.
    A reduction over a contiguous innermost axis accumulates one vector of
    partial results per row (rfactor) and folds it at the end; spatial blocks
    are vectorized along their innermost axis.
    """

    def _schedule(self, func, target):
        sch = s_tir.Schedule(func)
        blocks = root_blocks(sch)
        if all(is_spatial(sch, b) for b in blocks) or not all(trivially_bound(sch, b) for b in blocks):
            return None
        # Inline plain copies (pad_temp of a 1x1 conv) and single-consumer elementwise steps;
        # a block with several consumers (softmax's exp) is computed once.
        for block in blocks[:-1]:
            if not is_spatial(sch, block) or has_if_then_else(sch.get(block)):
                continue
            if len(sch.get_consumers(block)) == 1 or isinstance(sch.get(block).body.value, tvm.ir.TensorLoad):
                with contextlib.suppress(Exception):
                    sch.compute_inline(block)
        blocks = root_blocks(sch)
        rows = _leading_spatial(sch, blocks)
        lanes = vector_lanes(target, str(sch.get(blocks[-1]).writes[0].source.dtype))
        if rows == 0:
            return _whole_reduction(sch, blocks, lanes)

        partials = {}  # rfactor block name -> the lane dimension of its buffer
        for block in blocks:
            if not is_spatial(sch, block):
                rf = _vector_partials(sch, block, lanes)
                if rf is not None:
                    partials[sch.get(rf[0]).name_hint] = rf[1]

        blocks = root_blocks(sch)
        loops = sch.get_loops(blocks[-1])
        outer = sch.fuse(*loops[:rows]) if rows > 1 else loops[0]
        large = max(total_elements(sch, b) for b in blocks) >= PARALLEL_MIN_ELEMENTS
        if (loop_bound(sch, outer) or 1) >= 2 and choose("reduction.parallel", large, (True, False)):
            sch.parallel(outer)
        for block in reversed(blocks[:-1]):
            sch.compute_at(block, outer, preserve_unit_loops=True)
        depth = loop_depth(sch, outer)
        for block in sch.get_child_blocks(outer):
            block_loops = sch.get_loops(block)[depth:]
            name = sch.get(block).name_hint
            if name in partials:
                _vectorize_partials(sch, block, block_loops, partials[name])
            elif block_loops and is_spatial(sch, block):
                extent = loop_extent(sch, block_loops[-1])
                if extent is None:  # symbolic: whole vectors, the tail peeled off
                    sch.vectorize(split_symbolic(sch, block_loops[-1], lanes)[1])
                    continue
                factor = pick_factor(extent, [lanes * 2, lanes, lanes // 2, lanes // 4])
                if (
                    (factor or 0) < lanes
                    and extent >= WHOLE_VECTORS_MIN * lanes
                    and choose("reduction.whole_vectors", True, (True, False))
                ):  # a row only part vectors divide (softmax over 1,500): whole vectors, then the tail
                    _whole_vectors_then_tail(sch, block_loops[-1], extent, lanes)
                    continue
                if factor is not None and factor >= 2:
                    vec = block_loops[-1] if factor == extent else sch.split(block_loops[-1], [None, factor])[1]
                    sch.vectorize(vec)
        return sch


def _whole_reduction(sch: s_tir.Schedule, blocks: list[SBlockRV], lanes: int) -> s_tir.Schedule | None:
    """A lone block that reduces its whole input to one value (the min and max a dynamic quantization
    scales by, BERT-base's 48 of them 6.6 ms as scalar loops): in vector partials, folded at the end."""
    if len(blocks) != 1 or sch.get(blocks[0]).writes[0].region:
        return None
    rf = _vector_partials(sch, blocks[0], lanes)
    if rf is None:
        return None
    _vectorize_partials(sch, rf[0], sch.get_loops(rf[0]), rf[1])
    return sch


def _whole_vectors_then_tail(sch: s_tir.Schedule, loop: LoopRV, extent: int, lanes: int) -> None:
    """Run ``loop`` as two loops: whole vectors over the most of its ``extent`` they divide, then the tail
    (vectorized too where it is two lanes or more). A split with a guard would scalarize the vectors."""
    whole, tail = sch.loop_partition(loop, [extent - extent % lanes, None])
    sch.vectorize(sch.split(whole, [None, lanes])[1])
    if extent % lanes >= 2:
        sch.vectorize(tail)


def _leading_spatial(sch: s_tir.Schedule, blocks: list[SBlockRV]) -> int:
    """How many leading spatial iters, with equal extents (constant or symbolic), all ``blocks`` share."""
    analyzer = tvm.sym.Analyzer()
    common: list | None = None
    for block in blocks:
        extents = []
        for iv in sch.get(block).iter_vars:
            if iv.iter_type != tirx.IterVar.DataPar or extent_bound(iv.dom.extent) is None:
                break
            extents.append(iv.dom.extent)
        if common is None:
            common = extents
        n = 0
        while n < min(len(common), len(extents)) and analyzer.can_prove_equal(common[n], extents[n]):
            n += 1
        common = common[:n]
    return len(common or [])


def _vector_partials(sch: s_tir.Schedule, block: SBlockRV, lanes: int) -> tuple[SBlockRV, int] | None:
    """rfactor a reduction over a contiguous innermost axis into per-lane partial results.

    Returns the rfactor block and the lane dimension of its buffer, or None (left serial).
    """
    stmt = sch.get(block)
    loops = sch.get_loops(block)
    # The innermost iter that is not a unit one (1x1 kernel axes) must be the reduction.
    position = next(
        (i for i in reversed(range(len(loops))) if (extent_bound(stmt.iter_vars[i].dom.extent) or 2) > 1), None
    )
    if position is None or stmt.iter_vars[position].iter_type != tirx.IterVar.CommReduce:
        return None
    if not isinstance(stmt.iter_vars[position].dom.extent, tirx.IntImm):
        return None  # a symbolic reduction stays serial
    extent = int(stmt.iter_vars[position].dom.extent)
    factor = pick_factor(extent, [lanes, lanes // 2])
    if factor is None or factor < 4 or extent // factor < 2 or not _contiguous_in(stmt, stmt.iter_vars[position].var):
        return None
    _, lane = sch.split(loops[position], factors=[None, factor])
    axis = len(stmt.writes[0].region)
    return sch.rfactor(lane, factor_axis=axis), axis


def _vectorize_partials(sch: s_tir.Schedule, block: SBlockRV, loops: list[LoopRV], axis: int) -> None:
    """Order an rfactor block's loops [spatial, reduce, lane], vectorize the lane loop."""
    stmt = sch.get(block)
    values = get_sblock_realize(sch, block).iter_values
    lane_var = stmt.writes[0].region[axis].min
    lane_value = next(v for iv, v in zip(stmt.iter_vars, values, strict=True) if iv.var.same_as(lane_var))
    lane = next(lp for lp in loops if sch.get(lp).loop_var.same_as(lane_value))
    spatial, reduce = [], []
    for loop in loops:
        if loop.same_as(lane):
            continue
        var = sch.get(loop).loop_var
        kinds = {iv.iter_type for iv, v in zip(stmt.iter_vars, values, strict=True) if var in vars_of(v)}
        (reduce if tirx.IterVar.CommReduce in kinds else spatial).append(loop)
    sch.reorder(*spatial, *reduce, lane)
    sch.vectorize(lane)
    sch.decompose_reduction(block, reduce[0])


def _contiguous_in(stmt, var) -> bool:
    """``var`` indexes only the innermost dimension of every buffer the block reads."""
    for region in stmt.reads:
        shape = region.source.shape
        dims = [vars_of(r.min) for r in region.region]
        # Trailing unit dims (a 1x1 spatial extent) do not break contiguity.
        while len(dims) > 1 and isinstance(shape[len(dims) - 1], tirx.IntImm) and int(shape[len(dims) - 1]) == 1:
            dims.pop()
        if any(var in d for d in dims[:-1]):
            return False
    return True


# --------------------------------------------------------------------------- vectorizable math
