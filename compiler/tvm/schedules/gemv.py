"""Matrix-vector products: a classifier's last layer at batch 1 (``1 x K @ K x N``), with its epilogue."""

from __future__ import annotations

from tvm import s_tir, tirx

from .base import (
    ACCUMULATOR_SCOPE,
    SafeRule,
    block_names,
    has_if_then_else,
    inline_injective,
    is_spatial,
    loop_depth,
    pick_factor,
    root_blocks,
    target_cores,
    vector_unit,
    vectorize_tile,
)
from .contraction_analysis import main_contraction

# Independent accumulators a column tile keeps: an FMA's latency (4 cycles) times the two FMA ports.
GEMV_ACCUMULATORS = 8
# Work below which a GEMV stays serial, in bytes of its matrix: it is bound by reading the matrix once,
# and a parallel launch costs ~3 us with two threads (about what 1 MiB takes from L2 on one core).
GEMV_PARALLEL_MIN_BYTES = 1 << 20
# The reduction must be long enough to give every accumulator its own partial sums.
GEMV_MIN_REDUCTION = 64


class Gemv(SafeRule):
    """A contraction with one output row: each vector of output columns has one accumulator chain in
    the plain contraction schedule, so it runs at an FMA's latency (ResNet-50's 2048 x 1000 classifier
    at batch 1: 1.06 ms against ONNX Runtime's 0.20, AMD EPYC Zen 3, AVX2).

    The reduction is split into interleaved parts, each summed in its own accumulators (rfactor), which
    are folded per column tile; the column tiles run in parallel when the matrix is large.
    """

    def _schedule(self, func, target):
        sch = s_tir.Schedule(func)
        reductions = [b for b in root_blocks(sch) if not is_spatial(sch, b)]
        if len(reductions) != 1 or any(has_if_then_else(sch.get(b)) for b in root_blocks(sch)):
            return None
        shape = sch.get(reductions[0]).writes[0].source.shape
        if sum(1 for dim in shape if not (isinstance(dim, tirx.IntImm) and int(dim) == 1)) != 1:
            return None  # not one output row (or a symbolic one): known before inlining anything
        main_name = sch.get(reductions[0]).name_hint
        inline_injective(sch)
        if block_names(sch).index(main_name) != 0:  # a producer left is not a plain copy
            return None
        found = main_contraction(sch, main_name)
        if found is None:
            return None
        main, info = found
        lanes = vector_unit(target).lanes(str(sch.get(main).writes[0].source.dtype))
        columns = info.extents[info.vec]
        reduction = info.extents[info.reduce[0]] if len(info.reduce) == 1 else 0
        if info.reg is not None or info.symbolic or info.outer is not None or columns % lanes:
            return None
        if reduction < GEMV_MIN_REDUCTION or any(info.extents[p] > 1 for p in info.spatial if p != info.vec):
            return None
        # The widest column tile of whole cache lines (2, 4 or 8 vectors, at most GEMV_ACCUMULATORS): each
        # reduction step reads it from a matrix row, and the reduction is split only to fill the rest of
        # the accumulators. A matrix worth both cores keeps a tile for each, and where its columns fill no
        # whole number of lines (a 1000-class classifier's) it takes line tiles, the last one guarded:
        # 1-vector tiles read each line twice, half at a time (ResNet-50's 2048 x 1000: 0.42 -> 0.23 ms).
        large = columns * reduction * 4 >= GEMV_PARALLEL_MIN_BYTES
        least_tiles = target_cores(target) if large else 1
        fits = [v for v in (8, 4, 2) if v <= GEMV_ACCUMULATORS and columns % (v * lanes) == 0]
        vectors = next((v for v in fits if columns // (v * lanes) >= least_tiles), 2 if large else 1)
        nr = vectors * lanes
        wanted = -(-GEMV_ACCUMULATORS // vectors)
        parts = pick_factor(reduction, [p for p in (wanted, 4, 2, 1) if p <= wanted])
        if parts is None:
            return None
        after = block_names(sch)[1:]

        loops = sch.get_loops(main)
        _, part = sch.split(loops[info.reduce[0]], factors=[None, parts])
        partial = sch.rfactor(part, factor_axis=0)

        # The fold: column tiles (the unit-extent spatial loops fused into them), the parts, the columns.
        loops = sch.get_loops(main)
        column_tile, column = sch.split(loops[info.vec], factors=[None, nr])
        spatial = [loops[p] for p in info.spatial if p != info.vec]
        fold_part = loops[-1]
        sch.reorder(*spatial, column_tile, fold_part, column)
        tile = sch.fuse(*spatial, column_tile) if spatial else column_tile
        if large and columns // nr >= target_cores(target):
            sch.parallel(tile)
        sch.compute_at(partial, tile, preserve_unit_loops=True)
        sch.set_scope(partial, 0, ACCUMULATOR_SCOPE)
        depth = loop_depth(sch, tile)
        inner = sch.get_loops(partial)[depth:]  # part, unit spatial..., column, outer reduction
        part_loop, column_loop, reduce_loop = inner[0], inner[-2], inner[-1]
        sch.reorder(reduce_loop, part_loop, column_loop)
        sch.unroll(part_loop)
        sch.vectorize(column_loop)
        vectorize_tile(sch, sch.decompose_reduction(partial, reduce_loop), tile)
        if after:
            sch.set_scope(main, 0, ACCUMULATOR_SCOPE)
            epilogue = sch.get_sblock(after[0])
            sch.reverse_compute_at(epilogue, tile, preserve_unit_loops=True)
            vectorize_tile(sch, epilogue, tile)
        sch.vectorize(column)
        sch.unroll(fold_part)
        vectorize_tile(sch, sch.decompose_reduction(main, fold_part), tile)
        return sch
