"""A grouped channel-blocked conv's output channel blocks split into (group, block within the group), so
that the blocks of a group, which read the same input channels, can share a register tile."""

from __future__ import annotations

from tvm import s_tir, tirx

from .base import block_names, product_of


def split_group_blocks(sch: s_tir.Schedule, main_name: str, max_block_bytes: int) -> bool:
    """Rewrite the conv block ``main_name`` (and its one epilogue) to iterate its output channel blocks as
    (group, block within the group). The input is read by group (``o // per_group * group_blocks + rco``),
    the weights by block: the block within the group is then an axis only the weights use, which the
    contraction rule register-blocks beside the map's columns (``ContractionInfo.outer``), each broadcast
    input value feeding the group's blocks. Unsplit, a tile held one block. ``False`` (and nothing
    changed) where the block is no grouped blocked conv with several blocks a group, or has no epilogue
    to hold its accumulators (its result would be the function's parameter, whose layout is fixed), or
    whose input map per channel block outgrows ``max_block_bytes``: such a conv keeps a packed weight panel
    and its pad per output row (``Contraction``). Nor a strided conv: its pad, computed up front once split,
    was a pass over the whole map, and ResNeXt-50's stride-2 one onto 14x14 ran 1.32x ONNX Runtime's time
    at batch 8, against 1.0x with the panel and its pad per row (AMD EPYC Zen 3, AVX2)."""
    names = block_names(sch)
    after = names[names.index(main_name) + 1 :]
    if len(after) != 1:
        return False
    main = sch.get_sblock(main_name)
    stmt = sch.get(main)
    if len(stmt.writes) != 1 or len(stmt.writes[0].region) != 5:  # NCHWc: a blocked conv's result
        return False
    out = stmt.writes[0]
    spatial = {iv.var: i for i, iv in enumerate(stmt.iter_vars) if iv.iter_type == tirx.IterVar.DataPar}
    found = None
    for region in stmt.reads:
        if region.source.same_as(out.source):
            continue
        for rng in region.region:
            division = _group_division(rng.min, spatial)
            found = found or (division and (*division, region.source, region.region[2:4]))
    if found is None:
        return False
    var, per_group, source, window = found
    shape = [int(d) for d in source.shape]
    if len(shape) != 5 or product_of(shape[2:]) * source.dtype.bits // 8 > max_block_bytes:
        return False
    if any(_strided(index.min, spatial) for index in window):
        return False
    position = spatial[var]
    dim = next((d for d, rng in enumerate(out.region) if rng.min.same_as(var)), None)
    extent = stmt.iter_vars[position].dom.extent
    if dim is None or not isinstance(extent, tirx.IntImm) or int(extent) % per_group:
        return False

    def split(at: int, ndim: int) -> tirx.IndexMap:
        return tirx.IndexMap.from_func(
            lambda *axes: (*axes[:at], axes[at] // per_group, axes[at] % per_group, *axes[at + 1 :]), ndim=ndim
        )

    epilogue = sch.get_sblock(after[0])
    epilogue_at = _reading_iter(sch.get(epilogue), out.source, dim)
    if epilogue_at is None:
        return False
    sch.transform_block_layout(main, split(position, len(stmt.iter_vars)))
    sch.transform_layout(main, ("write", 0), split(dim, len(out.region)))
    sch.transform_block_layout(epilogue, split(epilogue_at, len(sch.get(epilogue).iter_vars)))
    return True


def _group_division(expr, spatial: dict) -> tuple[tirx.Var, int] | None:
    """``(o, k)`` where ``expr`` holds ``o // k`` of a spatial iter ``o`` and a constant ``k > 1``."""
    return next(((t.a, int(t.b)) for t in _terms(expr, tirx.FloorDiv) if _spatial_by_constant(t, spatial)), None)


def _strided(expr, spatial: dict) -> bool:
    """Whether ``expr`` steps a spatial iter by a constant past 1 (a strided conv's input row or column)."""
    return any(_spatial_by_constant(t, spatial) for t in _terms(expr, tirx.Mul))


def _terms(expr, kind):
    """The nodes of type ``kind`` in ``expr``'s tree of sums, differences and products (an index)."""
    if isinstance(expr, kind):
        yield expr
    if isinstance(expr, tirx.Add | tirx.Sub | tirx.Mul):
        yield from _terms(expr.a, kind)
        yield from _terms(expr.b, kind)


def _spatial_by_constant(node, spatial: dict) -> bool:
    """Whether ``node`` (a division or product) is a spatial iter by a constant past 1."""
    return isinstance(node.a, tirx.Var) and node.a in spatial and isinstance(node.b, tirx.IntImm) and int(node.b) > 1


def _reading_iter(stmt, buffer, dim: int) -> int | None:
    """The position of the iter by which ``stmt`` reads ``buffer``'s dimension ``dim`` plainly."""
    positions = {iv.var: i for i, iv in enumerate(stmt.iter_vars)}
    for region in stmt.reads:
        if region.source.same_as(buffer):
            index = region.region[dim].min
            return positions.get(index) if isinstance(index, tirx.Var) else None
    return None
