"""Contractions: matmul, batch matmul, conv2d (incl. depthwise and padded) and
pooling, each with its fused producers and epilogue, tiled into registers,
vectorized and run in parallel when large."""

from __future__ import annotations

import contextlib

import tvm
from tvm import s_tir, tirx

from .base import (
    ACCUMULATOR_SCOPE,
    MAX_UNROLLED_COPIES,
    PARALLEL_MIN_MACS,
    PARALLEL_MIN_MACS_BLOCKED,
    PARALLEL_MIN_MACS_NO_REUSE,
    LoopRV,
    SafeRule,
    SBlockRV,
    block_names,
    extent_bound,
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
    trivially_bound,
    vars_of,
    vector_unit,
    vectorize_tile,
    whole_vector_tile,
)
from .flat_map import flatten_pointwise_map
from .gates import epilogues, mark_broadcast, stages_after
from .groups import split_group_blocks
from .pads import pad_per_channel, schedule_pad_stage
from .panel import packable_operand, panel_axes
from .register_tile import (
    ContractionInfo,
    outer_tile,
    padded_rows,
    ragged_outer_tile,
    reduction_chunk,
    tile_sizes,
)

# Rows a register tile along an axis within one image (a map's columns, a sequence) needs to be preferred
# to one across the batch.
MIN_WITHIN_ROWS = 4

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
        for name in block_names(sch):
            if name == main_name:
                break
            if not has_if_then_else(sch.get(sch.get_sblock(name))):  # a pad stays a stage
                with contextlib.suppress(Exception):
                    sch.compute_inline(sch.get_sblock(name))
        names = block_names(sch)
        gate = mark_broadcast(sch, main_name)
        inline_injective(sch, keep=set(names[: names.index(main_name)]) | ({gate} if gate else set()))
        padded = any(has_if_then_else(sch.get(sch.get_sblock(name))) for name in names[: names.index(main_name)])
        split_group_blocks(sch, main_name, PER_CHANNEL_PAD_BYTES)
        found = main_contraction(sch, main_name, padded)
        if found is None:
            return None
        main, info = found
        unit = vector_unit(target)
        lanes = unit.lanes(str(sch.get(main).writes[0].source.dtype))
        if flatten_pointwise_map(sch, main, info, lanes, unit):
            found = main_contraction(sch, main_name, padded)
            if found is None:
                return None
            main, info = found

        n = info.extents[info.vec]
        # A symbolic axis of a matmul is padded to whole tiles too: a guard inside the accumulation ran
        # the last tile scalar (rec's 12 rows at width 100 in a 16-row tile: 0.69 against 0.29 ms).
        symbolic_vec = info.vec in info.symbolic
        symbolic_reg = info.reg is not None and info.reg in info.symbolic
        ragged = not symbolic_vec and n > lanes and whole_vector_tile(n, lanes) is None
        rows = padded_rows(info, lanes, unit.accumulators)
        if allow_pad and (symbolic_vec or symbolic_reg or ragged or rows):
            mr, nr = tile_sizes(info, lanes, unit.accumulators)
            padding = [1] * len(info.extents)
            padding[info.vec] = nr if symbolic_vec else lanes if ragged else 1
            if symbolic_reg or rows:
                padding[info.reg] = rows or mr
            sch.pad_einsum(main, padding)
            after = epilogues(sch, main_name)
            if len(after) > 1:  # the copy out of the padded result, then the epilogue
                sch.compute_inline(sch.get_sblock(after[0]))
            found = main_contraction(sch, main_name, padded)
            if found is None:
                return None
            main, info = found
        names = block_names(sch)
        producers = names[: names.index(main_name)]
        after = epilogues(sch, main_name)
        mr, nr = tile_sizes(info, lanes, unit.accumulators)
        ov, mr = outer_tile(info, lanes, nr, mr, unit)
        # A tile whose last one is partial, not for a conv over its input as it is (ConvNeXt's 2x2
        # stride-2 384 -> 768 one onto a 7x7 map ran 1.09-1.28x the time of 1 x 7 so; AMD EPYC Zen 3, AVX2).
        partial = ragged_outer_tile(info, lanes, nr, unit) if info.exact_width else None
        if partial is not None:
            ov, mr = partial

        # A weight panel (A @ B: B's K x nr columns) packed once per column tile, reused by every row tile.
        packed = None
        if not info.symbolic and ov == 1:  # a padded matmul's producers pad its rows, not the panel's operand
            packed = packable_operand(sch, main, info, mr, nr, cores=target_cores(target))
            produced = {sch.get(sch.get_sblock(name)).writes[0].source.name for name in producers}
            packed = None if packed in produced else packed
        panel_iters = panel_axes(sch.get(main), info, packed) if packed is not None else []

        # A single pad indexed by plain (batch, channel) axes is computed per channel (not a padded matmul's
        # rows: its column tiles are the parallel loop).
        per_channel: list[int] = []
        pad_rows = False
        if len(producers) == 1 and packed is None:
            tiled = (info.vec, info.reg, info.outer)
            plain_iters = _plain_iters(sch, main, producers[0], info)
            plain = [p for p in plain_iters if p not in tiled]
            shares = product_of(info.extents[p] for p in plain)
            # Per block of channel lanes (the vector indexes the pad plainly); NCHW pads one channel at a time.
            blocks = info.vec in plain_iters
            pad_bytes = total_elements(sch, sch.get_sblock(producers[0])) * 4 // max(1, shares) if blocks else 0
            # Not for a partial tile (its loop is chunked): with the pad per image and the chunked tiles
            # under it, ResNet-50 at batch 8 ran 1.10x the time of the build before; with the pad up
            # front, as at batch 1, 1.01x (AMD EPYC Zen 3, AVX2).
            if plain and shares >= 2 * target_cores(target) and pad_bytes <= PER_CHANNEL_PAD_BYTES and not partial:
                per_channel = plain
            elif len(plain) >= 2:
                # A depthwise conv (or pool) with too few channel blocks to share out, or whose padded map
                # per channel block outgrows L2 (MobileNetV3's 16-channel 112x112 one: its pad was one serial
                # pass over the map, 4.9x ONNX Runtime's time): the pad is computed per output row too, as
                # the rows of taps that row reads.
                rows = [p for p in info.spatial if p not in tiled and p not in plain and info.extents[p] > 1]
                per_channel = plain + rows[:1] if rows else []
                pad_rows = bool(rows)

        loops = sch.get_loops(main)
        first: list[LoopRV] = []  # fused and parallel
        second: list[LoopRV] = []  # serial tile loops under it (per-channel pads; the rows of a packed panel)
        reg_inner = vec_inner = outer_inner = reg_outer = None
        for pos in info.spatial:
            loop = loops[pos]
            if per_channel:
                group = first if pos in per_channel else second
            else:
                group = second if (packed is not None and pos not in panel_iters) else first
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
        # A partial tile's loop always moves so (``ragged_outer_tile``): the last tile is peeled off it below.
        chunk = reduction_chunk(info, ov, lanes) if ov > 1 and (partial is not None or reg_outer in first) else None
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
        threshold = PARALLEL_MIN_MACS if info.reuse else PARALLEL_MIN_MACS_NO_REUSE
        if info.outer is not None and info.reg is not None and info.extents[info.reg] > 1:
            threshold = min(threshold, PARALLEL_MIN_MACS_BLOCKED)
        if fused is not None and product_of(info.extents) >= threshold and (loop_bound(sch, fused) or 1) >= 2:
            sch.parallel(fused)

        # The tile accumulates in its own buffer (on the stack); the epilogue (or a write-back) reads it per tile.
        if after:
            epilogue = sch.get_sblock(after[0])
            sch.set_scope(main, 0, ACCUMULATOR_SCOPE)
        else:
            epilogue = sch.cache_write(main, 0, ACCUMULATOR_SCOPE)
        if tile is not None:
            sch.reverse_compute_at(epilogue, tile, preserve_unit_loops=True)
            vectorize_tile(sch, epilogue, tile, max_copies=row_copies)
        for name in stages_after(sch, main_name):  # a broadcast of the result (gates.py)
            schedule_stage(sch, sch.get_sblock(name), target)
        if info.vec in info.symbolic and info.multiple.get(info.vec, 1) > 1 and info.multiple[info.vec] % nr:
            # A k * W width (a detector's level, not padded: see legalize.py) whose last tile may be a guarded
            # tail: its accumulators are indexed within the tile, or the guard keeps the local buffer from
            # being compacted (a whole row of them in memory: 2.5x).
            position = info.spatial.index(info.vec)
            sch.transform_layout(
                main,
                ("write", 0),
                lambda *dims: [d % nr if i == position else d for i, d in enumerate(dims)],
                assume_injective_transform=True,
            )
        # Loop kinds before decompose_reduction: the update block stops being a complete
        # reduction block once its init is split off, and vectorize checks that.
        for inner in (outer_inner, reg_inner):
            if inner is not None:
                sch.unroll(inner)
        if nr > 1:
            sch.vectorize(vec_inner)
        vectorize_tile(sch, sch.decompose_reduction(main, reduce_loops[0]), tile, max_copies=row_copies)
        if partial is not None:
            # The whole tiles, then the last, partial one: each loop's bounds decide its guard (true, or a
            # constant per unrolled column), so no tile tests a column inside the accumulation. The init
            # keeps its guard: a store per column a row.
            sch.loop_partition(reg_outer, [info.extents[info.reg] // mr, None])

        if packed is not None:
            reads = [r.source.name for r in sch.get(main).reads]
            # On the stack: a workspace allocation per panel left the pool holding memory after a
            # model's delete (+14 MB in the release test); packable_operand caps the panel's size.
            panel = sch.cache_read(main, reads.index(packed), "local")
            sch.compute_at(panel, fused, preserve_unit_loops=True)
            vectorize_tile(sch, panel, fused)
        # The pad inside the loop nest: per channel (and row) under the parallel loop, or a packed conv's
        # under its row loop; else once up front.
        pad_at, decompose = (fused, not pad_rows) if per_channel else (None, False)
        if packed is not None:  # never per channel
            pad_at = _packed_pad_row(sch, info, producers, second, loops)
        for name in producers:
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
            else:
                sch = trial
        return sch


def _analyze_contraction(sch: s_tir.Schedule, block: SBlockRV, padded: bool) -> ContractionInfo | None:
    stmt = sch.get(block)
    if len(stmt.writes) != 1 or not trivially_bound(sch, block):
        return None
    iter_vars = list(stmt.iter_vars)
    bounds = [extent_bound(iv.dom.extent) for iv in iter_vars]
    if any(b is None for b in bounds):
        return None
    extents = [int(b) for b in bounds]
    symbolic = frozenset(i for i, iv in enumerate(iter_vars) if not isinstance(iv.dom.extent, tirx.IntImm))
    multiple = {i: _known_multiple(iter_vars[i].dom.extent) for i in symbolic}
    spatial = [i for i, iv in enumerate(iter_vars) if iv.iter_type == tirx.IterVar.DataPar]
    reduce = [i for i, iv in enumerate(iter_vars) if iv.iter_type == tirx.IterVar.CommReduce]
    if not reduce or not spatial or len(spatial) + len(reduce) != len(iter_vars):
        return None
    # The output is indexed by the spatial iters, in order.
    out = stmt.writes[0]
    if len(out.region) != len(spatial):
        return None
    if not all(rng.min.same_as(iter_vars[p].var) for rng, p in zip(out.region, spatial, strict=True)):
        return None
    vec = next((p for p in reversed(spatial) if extents[p] > 1), None)
    if vec is None:
        return None
    vec_var = iter_vars[vec].var
    reads = [r for r in stmt.reads if not r.source.same_as(out.source)]
    # Indices simplified over the iters' ranges: a grouped conv's split blocks read the input by
    # ``(g * k + j) // k``, which is ``g`` (groups.py).
    analyzer = tvm.sym.Analyzer()
    for iv in iter_vars:
        analyzer.bind(iv.var, iv.dom)
    # Vector loads must be contiguous: the vector iter may index only innermost dimensions.
    streamed, broadcast = [], []
    for region in reads:
        dims = [vars_of(analyzer.simplify(r.min)) for r in region.region]
        if any(vec_var in d for d in dims[:-1]):
            return None
        (streamed if dims and vec_var in dims[-1] else broadcast).append(dims)
    if not reads or not streamed:
        return None

    def streamed_use(p: int) -> bool:
        return any(iter_vars[p].var in d for dims in streamed for d in dims)

    exact_width = padded or all(extents[p] == 1 for p in reduce[1:-1])
    # Register-block the largest axis the streamed operands do not depend on: its values are
    # broadcast and every vector load is reused across the tile's rows. Where the tile may be partial
    # (``ContractionInfo.exact_width``), the batch only where no other axis has
    # MIN_WITHIN_ROWS: at batch 8 a conv onto a 7x7 map tiled 8 images, each broadcast from its own
    # image, and ResNet-50's 3x3 512-channel one ran 1.91x ONNX Runtime's time against 1.19x with
    # tiles along the map's columns. ConvNeXt's unpadded 2x2 downsampling onto 7x7 ran 1.08x the time
    # of 8 images a tile with 1 x 7 (AMD EPYC Zen 3, AVX2).
    candidates = [p for p in spatial if p != vec and extents[p] > 1 and not streamed_use(p)]
    if candidates:
        within = [p for p in candidates if p != spatial[0] and extents[p] >= MIN_WITHIN_ROWS] if exact_width else []
        reg = max(within or candidates, key=lambda p: (extents[p], p))
        outers = [
            p for p in spatial
            if p not in (vec, reg) and extents[p] > 1 and p not in symbolic and streamed_use(p)
            and not any(iter_vars[p].var in d for dims in broadcast for d in dims)
        ]  # fmt: skip
        outer = max(outers, key=lambda p: (extents[p], p)) if outers else None
        return ContractionInfo(spatial, reduce, vec, reg, True, extents, symbolic, multiple, outer, exact_width)
    # No reuse to win (depthwise conv, pooling): block the axis next to the vector one anyway,
    # for independent accumulators.
    before = [p for p in spatial if p < vec and extents[p] > 1]
    return ContractionInfo(spatial, reduce, vec, before[-1] if before else None, False, extents, symbolic, multiple)


def main_contraction(
    sch: s_tir.Schedule, main_name: str, padded: bool = False
) -> tuple[SBlockRV, ContractionInfo] | None:
    """The contraction block and its analysis, when it has at most one epilogue; ``padded`` where it
    reads a pad stage."""
    if len(epilogues(sch, main_name)) > 1:
        return None
    main = sch.get_sblock(main_name)
    info = _analyze_contraction(sch, main, padded)
    return None if info is None else (main, info)


def _plain_iters(sch: s_tir.Schedule, main: SBlockRV, producer: str, info: ContractionInfo) -> list[int]:
    """Spatial iters that alone index a dimension of ``producer`` (batch; channel of a depthwise conv)."""
    stmt = sch.get(main)
    regions = [r for r in stmt.reads if r.source.name == producer]
    if len(regions) != 1:
        return []
    by_var = {stmt.iter_vars[p].var: p for p in info.spatial}
    unit = {stmt.iter_vars[p].var for p in info.reduce if info.extents[p] == 1}
    plain = []
    for rng in regions[0].region:
        used = [v for v in vars_of(rng.min) if v not in unit]
        if len(used) == 1 and used[0] in by_var:
            plain.append(by_var[used[0]])
    return sorted(plain)


def _known_multiple(extent) -> int:
    """The largest number a symbolic extent is provably a multiple of (1 when none is known)."""
    known = tvm.sym.Analyzer().modular_set(extent)
    return int(known.coeff) if int(known.base) == 0 and int(known.coeff) > 0 else 1


def _split_tile(sch: s_tir.Schedule, loop: LoopRV, factor: int) -> tuple[LoopRV, LoopRV]:
    outer, inner = sch.split(loop, factors=[None, factor])
    return outer, inner


def _packed_pad_row(
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


# --------------------------------------------------------------------------- row-reduction helpers
