"""A channel-blocked pointwise conv's map flattened: its rows and columns as one axis of positions.

The register tile takes a divisor of the columns it blocks. A 14-wide map offers 7 (or 2), and with
EfficientNet's 14 output channel blocks (112 channels) the best tile was 1 block x 7 columns: each
weight vector fed 7 FMAs at an FMA's latency. Over the 196 positions of the whole map a 2 x 4 tile
fits: a 672 -> 112 1x1 conv at 8x14x14 ran 2.10 -> 1.34 ms, against ONNX Runtime's 1.33 (AMD EPYC
Zen 3, AVX2). A 1x1 stride-1 conv reads its input at the position it writes, and NCHWc keeps a
block's positions contiguous, so the flattened axis indexes every buffer as the (row, column) pair did.

Flattened only where the tile estimate (``register_tile.best_outer_tile``) improves: EfficientNet-B0's
and MobileNetV3's two 14x14 1x1 convs into 112 channels, RegNetY's 784-channel one at batch 8. The zoo
timed 0.95-1.03x of before, within noise (AMD EPYC Zen 3, AVX2).
"""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx

from .base import SBlockRV, VectorUnit, block_names
from .register_tile import ContractionInfo, flattening_pays


def flatten_pointwise_map(
    sch: s_tir.Schedule, main: SBlockRV, info: ContractionInfo, lanes: int, unit: VectorUnit
) -> bool:
    """Flatten the (row, column) iters of ``main`` and of its one epilogue where that pays; returns
    whether it did (the contraction must then be analyzed again)."""
    if info.symbolic or info.reg is None or info.outer is None:
        return False
    column = info.reg
    row = column - 1
    if row not in info.spatial or row in (info.outer, info.vec):
        return False
    width = info.extents[column]
    if not flattening_pays(info, lanes, unit, info.extents[row] * width):
        return False
    names = block_names(sch)
    after = names[names.index(sch.get(main).name_hint) + 1 :]
    if len(after) != 1:  # the main block must write an intermediate whose layout can change
        return False
    epilogue = sch.get_sblock(after[0])
    stmt = sch.get(main)
    unit = [p for p in info.reduce if info.extents[p] == 1]
    position = info.spatial.index(row)  # in the output's dims and in the epilogue's iters
    if not _reads_pairs_plainly(stmt, row, column, [stmt.iter_vars[p] for p in unit]):
        return False
    if not _epilogue_mirrors(sch.get(epilogue), stmt.writes[0].source, len(info.spatial)):
        return False
    sch.transform_layout(main, ("write", 0), _flattened_index_map(position, len(info.spatial), width))
    # The unit reduce iters (a 1x1 window's) are dropped: remapped, they would come back spatial.
    sch.transform_block_layout(main, _flattened_index_map(row, len(stmt.iter_vars), width, drop=unit))
    sch.transform_block_layout(epilogue, _flattened_index_map(position, len(info.spatial), width))
    return True


def _flattened_index_map(at: int, ndim: int, width: int, drop: list[int] = ()) -> tirx.IndexMap:
    """(..., i_at, i_at+1, ...) -> (..., i_at * width + i_at+1, ...), the ``drop`` positions left out."""

    def mapped(*indices):
        kept = [(i, v) for i, v in enumerate(indices) if i not in drop and i not in (at, at + 1)]
        before = [v for i, v in kept if i < at]
        return (*before, indices[at] * width + indices[at + 1], *[v for i, v in kept if i > at])

    return tirx.IndexMap.from_func(mapped, ndim=ndim, index_dtype="int64")


def _reads_pairs_plainly(stmt, row: int, column: int, unit_iters: list) -> bool:
    """Every buffer ``stmt`` touches indexes the row and column iters, if at all, as two adjacent dims
    at exactly those iters' values (the unit window iters aside), spanning the dims whole."""
    row_var, column_var = stmt.iter_vars[row].var, stmt.iter_vars[column].var
    extents = (stmt.iter_vars[row].dom.extent, stmt.iter_vars[column].dom.extent)
    analyzer = tvm.sym.Analyzer()
    for unit in unit_iters:
        analyzer.bind(unit.var, unit.dom.min)
    for region in [*stmt.reads, *stmt.writes]:
        indices = [analyzer.simplify(r.min) for r in region.region]
        uses = [
            i for i, index in enumerate(indices) if {row_var, column_var} & set(tirx.analysis.undefined_vars(index))
        ]
        if not uses:
            continue
        if len(uses) != 2 or uses[1] != uses[0] + 1:
            return False
        pair = (indices[uses[0]], indices[uses[1]])
        if not (pair[0].same_as(row_var) and pair[1].same_as(column_var)):
            return False
        dims = (region.source.shape[uses[0]], region.source.shape[uses[1]])
        if not all(analyzer.can_prove_equal(d, e) for d, e in zip(dims, extents, strict=True)):
            return False
    return True


def _epilogue_mirrors(epilogue, intermediate, ndim: int) -> bool:
    """The epilogue's iters are the output's dims: it reads the main block's result at exactly them."""
    iters = [iv.var for iv in epilogue.iter_vars]
    if len(iters) != ndim or any(iv.iter_type != tirx.IterVar.DataPar for iv in epilogue.iter_vars):
        return False
    regions = [r for r in epilogue.reads if r.source.same_as(intermediate)]
    return bool(regions) and all(
        all(rng.min.same_as(var) for rng, var in zip(region.region, iters, strict=True)) for region in regions
    )
