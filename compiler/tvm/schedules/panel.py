"""Packed weight panels: a matmul's streamed operand copied into contiguous K x nr column panels, each
reused by every row tile."""

from __future__ import annotations

from tvm import s_tir

from .base import SBlockRV, product_of, vars_of
from .register_tile import ContractionInfo

# A packed weight panel lives on a worker thread's stack: K x nr floats at most this size.
MAX_PANEL_BYTES = 512 * 1024


def packable_operand(
    sch: s_tir.Schedule, main: SBlockRV, info: ContractionInfo, mr: int, nr: int, *, cores: int
) -> str | None:
    """The buffer name of a matmul's streamed operand worth packing into column panels, else ``None``.

    That operand (B of A @ B, vector-loaded along the output columns) is read K rows apart:
    unpacked, each row tile re-streams it from L2 or beyond (rows 4 KB apart fall into one
    L1 set). Packed per column tile, its K x nr panel is contiguous and every row tile reuses
    it. Only plain matmuls (each index one iter, none the rows'), with row tiles to share a
    panel and enough column tiles to keep every core busy.
    """
    if not info.reuse or info.reg is None or nr <= 1:
        return None
    stmt = sch.get(main)
    iters = {iv.var: p for p, iv in enumerate(stmt.iter_vars)}
    vec_var, reg_var = stmt.iter_vars[info.vec].var, stmt.iter_vars[info.reg].var
    out = stmt.writes[0].source
    for region in stmt.reads:
        if region.source.same_as(out):
            continue
        dims = [vars_of(r.min) for r in region.region]
        if not dims or vec_var not in dims[-1]:
            continue
        if any(len(d) != 1 or not d <= set(iters) or reg_var in d for d in dims):
            return None
        if not any(
            int(r.extent) == 1 and iters[next(iter(d))] in info.reduce for r, d in zip(region.region, dims, strict=True)
        ):
            return None
        reduce_extent = product_of(info.extents[p] for p in info.reduce)
        if reduce_extent * nr * 4 > MAX_PANEL_BYTES:
            return None
        row_tiles = info.extents[info.reg] // mr
        column_tiles = product_of(info.extents[p] for p in panel_axes(stmt, info, region.source.name)) // nr
        if row_tiles < 2 or column_tiles < 2 * cores:
            return None
        return region.source.name
    return None


def panel_axes(stmt, info: ContractionInfo, operand: str) -> list[int]:
    """The spatial iters a packed operand is indexed by (its columns; a batch matmul's batch): the
    parallel loop; every other spatial iter (rows; a batch the operand is shared by) reuses the panel."""
    region = next(r for r in stmt.reads if r.source.name == operand)
    used = set().union(*(vars_of(r.min) for r in region.region))
    return [p for p in info.spatial if stmt.iter_vars[p].var in used]
