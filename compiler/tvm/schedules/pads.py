"""A contraction's pad producer: computed inside the parallel loop (per channel, and row) or once up
front (a zero fill and a copy of the interior, or for a channel-blocked map one pass by rows)."""

from __future__ import annotations

import contextlib

import tvm
from tvm import s_tir, tirx

from .base import (
    PARALLEL_MIN_ELEMENTS,
    LoopRV,
    SBlockRV,
    has_if_then_else,
    loop_depth,
    loop_extent,
    total_elements,
    vectorize_innermost,
    vectorize_tile,
)
from .register_tile import ContractionInfo


def pad_per_channel(sch: s_tir.Schedule, block: SBlockRV, fused: LoopRV, lanes: int, *, decompose: bool) -> None:
    """The pad computed inside the parallel loop, for the channels (and rows) each iteration reads: a
    zero fill and a copy of the interior, or (``decompose`` false) one pass whose bounds test is per
    pixel, not per lane (decompose_padding refuses a few rows of taps, and they ran 30% faster so)."""
    sch.compute_at(block, fused, preserve_unit_loops=True)
    sch.set_scope(block, 0, "local")
    if not decompose:
        vectorize_tile(sch, block, fused, lanes)
        return
    fill = sch.decompose_padding(block, sch.get_loops(block)[loop_depth(sch, fused)])
    vectorize_tile(sch, fill, fused, lanes)
    vectorize_tile(sch, block, fused, lanes)


def bounded_plainly(sch: s_tir.Schedule, name: str) -> bool:
    """Whether the loops of pad ``name`` (and of its zero fill) computed inside the tile loops have extents
    free of min and max. Over a symbolic map both symbolic in the tile loops, the region TVM gives a
    per-channel pad is bounded by ``max(0, x) - min(0, x)`` (it cannot tell ``x``'s sign), and LoopPartition,
    peeling the guarded tail of such a loop, recursed some 50,000 loops deep and crashed the compile
    (YOLOv8n's SPPF pool at height and width 257..1024). Such a pad is computed once up front instead."""
    for block in _blocks_named(sch, name):
        if any(_has_min_max(sch.get(loop).extent) for loop in sch.get_loops(block)):
            return False
    return True


def _blocks_named(sch: s_tir.Schedule, name: str) -> list[SBlockRV]:
    """The pad block and its zero fill (``name_pad_const``), wherever they sit."""
    found = []
    for suffix in ("", "_pad_const"):
        with contextlib.suppress(Exception):
            found.append(sch.get_sblock(name + suffix))
    return found


def _has_min_max(expr) -> bool:
    if isinstance(expr, tirx.Min | tirx.Max):
        return True
    children = (getattr(expr, field, None) for field in ("a", "b", "value"))
    return any(_has_min_max(child) for child in children if tvm.ir.is_prim_expr(child))


def schedule_pad_stage(sch: s_tir.Schedule, block: SBlockRV, lanes: int) -> None:
    """A root-level pad: a zero fill plus a vectorized copy of the interior, or for a channel-blocked map
    (its innermost loop one vector) one pass a row at a time (see ``_pad_by_rows``)."""
    parallel = total_elements(sch, block) >= PARALLEL_MIN_ELEMENTS
    loops = sch.get_loops(block)
    if len(loops) >= 3 and loop_extent(sch, loops[-1]) == lanes and all(loop_extent(sch, x) for x in loops):
        _pad_by_rows(sch, block, parallel)
        return
    if has_if_then_else(sch.get(block)):
        fill = None
        with contextlib.suppress(Exception):
            fill = sch.decompose_padding(block, sch.get_loops(block)[0])
        if fill is not None:
            vectorize_innermost(sch, fill, lanes, parallel)
    vectorize_innermost(sch, block, lanes, parallel)


def _pad_by_rows(sch: s_tir.Schedule, block: SBlockRV, parallel: bool) -> None:
    """A blocked map's pad in one pass: a row per parallel iteration, its pixels in a serial loop, each
    pixel's vector stored whole (the bounds test is per pixel). Fused down to single pixels, as a zero
    fill and then a copy, every vector paid a division and a modulo per index: ResNet-50's 64-channel
    3x3 conv at 56x56 ran 1.65 ms, 1.33 so, against ONNX Runtime's 1.26 (AMD EPYC Zen 3, AVX2)."""
    loops = sch.get_loops(block)
    sch.vectorize(loops[-1])
    rows = sch.fuse(*loops[:-2]) if len(loops) > 3 else loops[0]
    if parallel:
        sch.parallel(rows)


def packed_pad_row(
    sch: s_tir.Schedule, info: ContractionInfo, producers: list[str], serial: list[LoopRV], loops: list[LoopRV]
) -> LoopRV | None:
    """The output-row loop a packed panel's conv computes its pad under, or ``None``.

    A grouped conv (RegNetY's 16-channel groups) packs its weights per output channel block and reads
    its input by group, not plainly by channel, so no per-channel pad applies: its pad was a pass over
    the whole map before the parallel loop (a 114x114x64 one, 3.3 MB). Under the row loop each iteration
    pads the rows of taps that row reads, for the channels of its group.
    """
    if len(producers) != 1 or info.symbolic or not has_if_then_else(sch.get(sch.get_sblock(producers[0]))):
        return None
    tiled = (info.vec, info.reg, info.outer)
    rows = [p for p in info.spatial if p not in tiled and info.extents[p] > 1 and loops[p] in serial]
    return loops[rows[0]] if rows else None
