"""Default schedules for LLVM targets, in the spirit of TVM's dlight.

Without them Relax emits naive loops on the CPU: nothing parallel, nothing
vectorized. Each rule matches a family of fused TIR functions and schedules
it; functions no rule matches stay as they are. A rule that is unsure, or
whose scheduling primitive fails, returns ``None``: the function then stays
naive but correct. Schedule primitives check their own preconditions, so a
schedule that applies computes what the naive loops compute.

- :class:`Contraction` -- matmul, batch matmul, conv2d (incl. depthwise and
  padded), pooling, each with its fused producers and epilogue.
- :class:`RowReduction` -- softmax, layer norm, mean / global pooling, GEMV:
  blocks that share leading (row) axes.
- :class:`Injective` -- elementwise, broadcast, transpose, reshape, pad.

:func:`vectorizable_math_pass` runs before the rules (and before tuning
extracts its tasks): it replaces float32 ``erf`` / ``exp`` / ``sigmoid``
blocks by polynomials LLVM can vectorize. The rules themselves use traced
schedule primitives only, so a rule's schedule can be stored and replayed as
a tuning record.

Runs in the compile child only (imports TVM).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight.cpu.base import CPUScheduleRule
from tvm.target import Target

SBlockRV = s_tir.schedule.SBlockRV
LoopRV = s_tir.schedule.LoopRV

_get_sblock_realize = tvm.get_global_func("s_tir.schedule.GetSBlockRealize")
_has_if_then_else = tvm.get_global_func("s_tir.schedule.HasIfThenElse")

# Work below which a loop nest stays serial: output elements (injective, row reductions) and
# multiply-adds (contractions). A parallel launch costs ~3 us with two TVM threads.
_PARALLEL_MIN_ELEMENTS = 1 << 20
_PARALLEL_MIN_MACS = 1 << 22
# Register tile budget of a contraction, in accumulator vectors: when the tile's rows share each
# vector load (matmul, conv), and when they do not (depthwise conv, pooling; 4 measured best).
_ACCUMULATOR_VECTORS = 16
_ACCUMULATOR_VECTORS_NO_REUSE = 4


# --------------------------------------------------------------------------- rules


class _SafeRule(CPUScheduleRule):
    """A CPU rule for which any scheduling error means 'does not apply'."""

    def apply(self, func, target: Target, tunable: bool):
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        try:
            return self._schedule(func, target)
        except Exception:  # noqa: BLE001 - any failure: leave the function naive
            return None

    def _schedule(self, func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
        raise NotImplementedError


class Contraction(_SafeRule):
    """One reduction block whose innermost output axis can be vectorized: matmul,
    batch matmul, conv2d (incl. depthwise), pooling -- with fused producers and epilogue.

    The innermost output axis is vectorized (a power-of-two number of vectors; a
    matmul whose axis has no such divisor is computed on a padded extent). An
    output axis the vector-loaded operand does not depend on (matmul rows, conv
    output channels) is register-blocked and unrolled, so each vector load feeds
    several FMAs. The reduction loops sit outside that register tile, which
    accumulates in a local buffer; the epilogue is computed per tile straight
    from it. The outer tiles are fused and run in parallel. Plain-copy producers
    are inlined; a padding producer is computed per channel inside the parallel
    loop (depthwise conv) or once up front, split into a zero fill and a
    vectorized copy of the interior.
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
        reductions = [b for b in _root_blocks(sch) if not _is_spatial(sch, b)]
        if len(reductions) != 1:
            return None
        main_name = sch.get(reductions[0]).name_hint
        for name in _block_names(sch):
            if name == main_name:
                break
            if not _has_if_then_else(sch.get(sch.get_sblock(name))):  # a pad stays a stage
                with contextlib.suppress(Exception):
                    sch.compute_inline(sch.get_sblock(name))
        names = _block_names(sch)
        _inline_injective(sch, keep=set(names[: names.index(main_name)]))
        found = _main_contraction(sch, main_name)
        if found is None:
            return None
        main, info = found
        lanes = _vector_lanes(target, str(sch.get(main).writes[0].source.dtype))

        n = info.extents[info.vec]
        if allow_pad and n > lanes and _pick_factor(n, [lanes * 2, lanes, lanes // 2]) is None:
            padding = [1] * len(info.extents)
            padding[info.vec] = lanes
            sch.pad_einsum(main, padding)
            names = _block_names(sch)
            after = names[names.index(main_name) + 1 :]
            if len(after) > 1:  # the copy out of the padded result, then the epilogue
                sch.compute_inline(sch.get_sblock(after[0]))
            found = _main_contraction(sch, main_name)
            if found is None:
                return None
            main, info = found
        names = _block_names(sch)
        producers = names[: names.index(main_name)]
        after = names[names.index(main_name) + 1 :]
        mr, nr = _tile_sizes(info, lanes)

        # A single pad indexed by plain (batch, channel) axes is computed per channel.
        per_channel: list[int] = []
        if len(producers) == 1:
            plain = [p for p in _plain_iters(sch, main, producers[0], info) if p not in (info.vec, info.reg)]
            if plain and _product(info.extents[p] for p in plain) >= 2 * _num_cores(target):
                per_channel = plain

        loops = sch.get_loops(main)
        first: list[LoopRV] = []  # fused and parallel
        second: list[LoopRV] = []  # serial tile loops under it (per-channel pads only)
        reg_inner = vec_inner = None
        for pos in info.spatial:
            loop = loops[pos]
            group = first if (not per_channel or pos in per_channel) else second
            if pos == info.vec:
                if nr < info.extents[pos]:
                    loop, vec_inner = sch.split(loop, factors=[None, nr])
                    group.append(loop)
                else:
                    vec_inner = loop
            elif pos == info.reg and mr > 1:
                if mr < info.extents[pos]:
                    loop, reg_inner = sch.split(loop, factors=[None, mr])
                    group.append(loop)
                else:
                    reg_inner = loop
            else:
                group.append(loop)
        reduce_loops = [loops[p] for p in info.reduce]
        sch.reorder(*first, *second, *reduce_loops, *[x for x in (reg_inner, vec_inner) if x is not None])
        fused = sch.fuse(*first) if len(first) > 1 else (first[0] if first else None)
        tile = second[-1] if second else fused
        if fused is not None and _product(info.extents) >= _PARALLEL_MIN_MACS and (_extent(sch, fused) or 1) >= 2:
            sch.parallel(fused)

        # The tile accumulates in a local buffer; the epilogue (or a write-back) reads it per tile.
        if after:
            epilogue = sch.get_sblock(after[0])
            sch.set_scope(main, 0, "local")
        else:
            epilogue = sch.cache_write(main, 0, "local")
        if tile is not None:
            sch.reverse_compute_at(epilogue, tile, preserve_unit_loops=True)
            _vectorize_tile(sch, epilogue, tile)
        # Loop kinds before decompose_reduction: the update block stops being a complete
        # reduction block once its init is split off, and vectorize checks that.
        if reg_inner is not None:
            sch.unroll(reg_inner)
        if nr > 1:
            sch.vectorize(vec_inner)
        _vectorize_tile(sch, sch.decompose_reduction(main, reduce_loops[0]), tile)

        for name in producers:
            block = sch.get_sblock(name)
            if per_channel:
                sch.compute_at(block, fused, preserve_unit_loops=True)
                sch.set_scope(block, 0, "local")
                fill = sch.decompose_padding(block, sch.get_loops(block)[_depth(sch, fused)])
                _vectorize_tile(sch, fill, fused)
                _vectorize_tile(sch, block, fused)
            else:
                _schedule_pad_stage(sch, block, lanes)
        return sch


class RowReduction(_SafeRule):
    """Blocks sharing leading spatial (row) axes, at least one a reduction: softmax,
    layer norm, mean / global pooling, GEMV with its epilogue.

    Rows are fused (parallel when large) and every block is computed per row.
    A reduction over a contiguous innermost axis accumulates one vector of
    partial results per row (rfactor) and folds it at the end; spatial blocks
    are vectorized along their innermost axis.
    """

    def _schedule(self, func, target):
        sch = s_tir.Schedule(func)
        blocks = _root_blocks(sch)
        if all(_is_spatial(sch, b) for b in blocks) or not all(_trivially_bound(sch, b) for b in blocks):
            return None
        # Inline plain copies (pad_temp of a 1x1 conv) and single-consumer elementwise steps;
        # a block with several consumers (softmax's exp) is computed once.
        for block in blocks[:-1]:
            if not _is_spatial(sch, block) or _has_if_then_else(sch.get(block)):
                continue
            if len(sch.get_consumers(block)) == 1 or isinstance(sch.get(block).body.value, tvm.ir.TensorLoad):
                with contextlib.suppress(Exception):
                    sch.compute_inline(block)
        blocks = _root_blocks(sch)
        rows = _leading_spatial(sch, blocks)
        if rows == 0:
            return None
        lanes = _vector_lanes(target, str(sch.get(blocks[-1]).writes[0].source.dtype))

        partials = {}  # rfactor block name -> the lane dimension of its buffer
        for block in blocks:
            if not _is_spatial(sch, block):
                rf = _vector_partials(sch, block, lanes)
                if rf is not None:
                    partials[sch.get(rf[0]).name_hint] = rf[1]

        blocks = _root_blocks(sch)
        loops = sch.get_loops(blocks[-1])
        outer = sch.fuse(*loops[:rows]) if rows > 1 else loops[0]
        if (_extent(sch, outer) or 1) >= 2 and max(_total_elements(sch, b) for b in blocks) >= _PARALLEL_MIN_ELEMENTS:
            sch.parallel(outer)
        for block in reversed(blocks[:-1]):
            sch.compute_at(block, outer, preserve_unit_loops=True)
        depth = _depth(sch, outer)
        for block in sch.get_child_blocks(outer):
            block_loops = sch.get_loops(block)[depth:]
            name = sch.get(block).name_hint
            if name in partials:
                _vectorize_partials(sch, block, block_loops, partials[name])
            elif block_loops and _is_spatial(sch, block):
                extent = _extent(sch, block_loops[-1]) or 1
                factor = _pick_factor(extent, [lanes * 2, lanes, lanes // 2, lanes // 4])
                if factor is not None and factor >= 2:
                    vec = block_loops[-1] if factor == extent else sch.split(block_loops[-1], [None, factor])[1]
                    sch.vectorize(vec)
        return sch


class Injective(_SafeRule):
    """Only spatial blocks (elementwise, broadcast, transpose, reshape, pad, concat):
    inline into the outputs, fuse each remaining loop nest, vectorize its innermost
    loop and run the rest in parallel when large."""

    def _schedule(self, func, target):
        sch = s_tir.Schedule(func)
        blocks = _root_blocks(sch)
        if not blocks or not all(_is_spatial(sch, b) for b in blocks):
            return None
        _inline_injective(sch)
        for block in _root_blocks(sch):
            if _trivially_bound(sch, block):
                lanes = _vector_lanes(target, str(sch.get(block).writes[0].source.dtype))
                parallel = _total_elements(sch, block) >= _PARALLEL_MIN_ELEMENTS
                _vectorize_innermost(sch, block, lanes, parallel)
        return sch


def default_cpu_rules() -> list:
    """The rules, most specific first (dlight applies the first that matches).

    dlight's own ``cpu.GEMV`` and ``cpu.Reduction`` made PP-OCR cls 3x slower
    than no rules at all (measured: 3.9x -> 11.5x of ONNX Runtime at batch 1).
    """
    return [Contraction(), RowReduction(), Injective()]


# --------------------------------------------------------------------------- contraction analysis


@dataclass
class _ContractionInfo:
    spatial: list[int]  # positions of the spatial iters in the block's iter list
    reduce: list[int]
    vec: int  # the vectorized iter: innermost non-unit output axis
    reg: int | None  # the register-blocked iter
    reuse: bool  # whether the vector-loaded operands are shared across ``reg``
    extents: list[int]


def _analyze_contraction(sch: s_tir.Schedule, block: SBlockRV) -> _ContractionInfo | None:
    stmt = sch.get(block)
    if len(stmt.writes) != 1 or not _trivially_bound(sch, block):
        return None
    iter_vars = list(stmt.iter_vars)
    extents = [int(iv.dom.extent) for iv in iter_vars]
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
    # Vector loads must be contiguous: the vector iter may index only innermost dimensions.
    streamed = []
    for region in reads:
        dims = [_vars_of(r.min) for r in region.region]
        if any(vec_var in d for d in dims[:-1]):
            return None
        if dims and vec_var in dims[-1]:
            streamed.append(dims)
    if not reads or not streamed:
        return None

    def streamed_use(p: int) -> bool:
        return any(iter_vars[p].var in d for dims in streamed for d in dims)

    # Register-block the largest axis the streamed operands do not depend on: its values are
    # broadcast and every vector load is reused across the tile's rows.
    candidates = [p for p in spatial if p != vec and extents[p] > 1 and not streamed_use(p)]
    if candidates:
        reg = max(candidates, key=lambda p: (extents[p], p))
        return _ContractionInfo(spatial, reduce, vec, reg, True, extents)
    # No reuse to win (depthwise conv, pooling): block the axis next to the vector one anyway,
    # for independent accumulators.
    before = [p for p in spatial if p < vec and extents[p] > 1]
    return _ContractionInfo(spatial, reduce, vec, before[-1] if before else None, False, extents)


def _main_contraction(sch: s_tir.Schedule, main_name: str) -> tuple[SBlockRV, _ContractionInfo] | None:
    """The contraction block and its analysis, when it has at most one epilogue."""
    if _epilogue_count(sch, main_name) > 1:
        return None
    main = sch.get_sblock(main_name)
    info = _analyze_contraction(sch, main)
    return None if info is None else (main, info)


def _tile_sizes(info: _ContractionInfo, lanes: int) -> tuple[int, int]:
    """Register tile: ``mr`` rows of the register-blocked axis by ``nr`` lanes of the vector axis.

    ``nr`` is a power-of-two number of vectors (or a part of one): LLVM spills odd-sized
    vectors (48 lanes ran 3x slower than 32 in a depthwise conv).
    """
    nr = _pick_factor(info.extents[info.vec], [lanes * 2, lanes, lanes * 4, lanes // 2, lanes // 4]) or 1
    if info.reg is None:
        return 1, nr
    vectors = max(1, -(-nr // lanes))
    budget = max(1, (_ACCUMULATOR_VECTORS if info.reuse else _ACCUMULATOR_VECTORS_NO_REUSE) // vectors)
    return _pick_factor(info.extents[info.reg], list(range(budget, 0, -1))) or 1, nr


def _plain_iters(sch: s_tir.Schedule, main: SBlockRV, producer: str, info: _ContractionInfo) -> list[int]:
    """Spatial iters that alone index a dimension of ``producer`` (batch; channel of a depthwise conv)."""
    stmt = sch.get(main)
    regions = [r for r in stmt.reads if r.source.name == producer]
    if len(regions) != 1:
        return []
    by_var = {stmt.iter_vars[p].var: p for p in info.spatial}
    unit = {stmt.iter_vars[p].var for p in info.reduce if info.extents[p] == 1}
    plain = []
    for rng in regions[0].region:
        used = [v for v in _vars_of(rng.min) if v not in unit]
        if len(used) == 1 and used[0] in by_var:
            plain.append(by_var[used[0]])
    return sorted(plain)


def _epilogue_count(sch: s_tir.Schedule, main_name: str) -> int:
    names = _block_names(sch)
    return len(names) - names.index(main_name) - 1


def _schedule_pad_stage(sch: s_tir.Schedule, block: SBlockRV, lanes: int) -> None:
    """A root-level pad: a zero fill plus a vectorized copy of the interior."""
    parallel = _total_elements(sch, block) >= _PARALLEL_MIN_ELEMENTS
    if _has_if_then_else(sch.get(block)):
        fill = None
        with contextlib.suppress(Exception):
            fill = sch.decompose_padding(block, sch.get_loops(block)[0])
        if fill is not None:
            _vectorize_innermost(sch, fill, lanes, parallel)
    _vectorize_innermost(sch, block, lanes, parallel)


def _vectorize_tile(sch: s_tir.Schedule, block: SBlockRV, tile: LoopRV | None) -> None:
    """The loops of ``block`` under ``tile``: vectorize the innermost, unroll the others."""
    loops = sch.get_loops(block)
    if tile is not None:
        loops = loops[_depth(sch, tile) :]
    if loops and (_extent(sch, loops[-1]) or 1) > 1:
        sch.vectorize(loops[-1])
    for loop in loops[:-1]:
        if (_extent(sch, loop) or 1) > 1:
            sch.unroll(loop)


# --------------------------------------------------------------------------- row-reduction helpers


def _leading_spatial(sch: s_tir.Schedule, blocks: list[SBlockRV]) -> int:
    """How many leading spatial iters, with equal extents, all ``blocks`` share."""
    common: list[int] | None = None
    for block in blocks:
        extents = []
        for iv in sch.get(block).iter_vars:
            if iv.iter_type != tirx.IterVar.DataPar or not isinstance(iv.dom.extent, tirx.IntImm):
                break
            extents.append(int(iv.dom.extent))
        if common is None:
            common = extents
        n = 0
        while n < min(len(common), len(extents)) and common[n] == extents[n]:
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
    position = next((i for i in reversed(range(len(loops))) if int(stmt.iter_vars[i].dom.extent) > 1), None)
    if position is None or stmt.iter_vars[position].iter_type != tirx.IterVar.CommReduce:
        return None
    extent = int(stmt.iter_vars[position].dom.extent)
    factor = _pick_factor(extent, [lanes, lanes // 2])
    if factor is None or factor < 4 or extent // factor < 2 or not _contiguous_in(stmt, stmt.iter_vars[position].var):
        return None
    _, lane = sch.split(loops[position], factors=[None, factor])
    axis = len(stmt.writes[0].region)
    return sch.rfactor(lane, factor_axis=axis), axis


def _vectorize_partials(sch: s_tir.Schedule, block: SBlockRV, loops: list[LoopRV], axis: int) -> None:
    """Order an rfactor block's loops [spatial, reduce, lane], vectorize the lane loop."""
    stmt = sch.get(block)
    values = _get_sblock_realize(sch, block).iter_values
    lane_var = stmt.writes[0].region[axis].min
    lane_value = next(v for iv, v in zip(stmt.iter_vars, values, strict=True) if iv.var.same_as(lane_var))
    lane = next(lp for lp in loops if sch.get(lp).loop_var.same_as(lane_value))
    spatial, reduce = [], []
    for loop in loops:
        if loop.same_as(lane):
            continue
        var = sch.get(loop).loop_var
        kinds = {iv.iter_type for iv, v in zip(stmt.iter_vars, values, strict=True) if var in _vars_of(v)}
        (reduce if tirx.IterVar.CommReduce in kinds else spatial).append(loop)
    sch.reorder(*spatial, *reduce, lane)
    sch.vectorize(lane)
    sch.decompose_reduction(block, reduce[0])


def _contiguous_in(stmt, var) -> bool:
    """``var`` indexes only the innermost dimension of every buffer the block reads."""
    for region in stmt.reads:
        shape = region.source.shape
        dims = [_vars_of(r.min) for r in region.region]
        # Trailing unit dims (a 1x1 spatial extent) do not break contiguity.
        while len(dims) > 1 and isinstance(shape[len(dims) - 1], tirx.IntImm) and int(shape[len(dims) - 1]) == 1:
            dims.pop()
        if any(var in d for d in dims[:-1]):
            return False
    return True


# --------------------------------------------------------------------------- vectorizable math

# Eigen's rational approximation of erf on [-4, 4] (TOPI's fast_erf): within 4e-7 of erf.
_ERF_ALPHA = (
    -2.72614225801306e-10,
    2.77068142495902e-08,
    -2.10102402082508e-06,
    -5.69250639462346e-05,
    -7.34990630326855e-04,
    -2.95459980854025e-03,
    -1.60960333262415e-02,
)
_ERF_BETA = (
    -1.45660718464996e-05,
    -2.13374055278905e-04,
    -1.68282697438203e-03,
    -7.37332916720468e-03,
    -1.42647390514189e-02,
)
# Cephes' expf (TOPI's fast_exp) with a two-constant Cody-Waite reduction: within 1e-7
# relative. The result is scaled by 2^(n-1) * 2 so that n covers [-126, 128]: finite up to
# ln(FLT_MAX); below exp(-87) results flush to zero.
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)
_EXP_HI = 88.72283
_EXP_LO = -87.33654


def _f32(value: float):
    return tirx.const(value, "float32")


def _erf_float32(arg):
    x = tirx.max(tirx.min(arg, _f32(4.0)), _f32(-4.0))
    x2 = x * x
    p = _f32(_ERF_ALPHA[0])
    for coefficient in _ERF_ALPHA[1:]:
        p = p * x2 + _f32(coefficient)
    q = _f32(_ERF_BETA[0])
    for coefficient in _ERF_BETA[1:]:
        q = q * x2 + _f32(coefficient)
    return tirx.Select(tirx.isnan(arg), arg, x * p / q)  # the clamp would turn NaN into +-1


def _exp_float32(arg):
    x = tirx.max(tirx.min(arg, _f32(_EXP_HI)), _f32(_EXP_LO))
    n = tirx.floor(x * _f32(1.44269504088896341) + _f32(0.5))
    f = x - n * _f32(0.693359375) - n * _f32(-2.12194440e-4)
    y = _f32(_EXP_POLY[0])
    for coefficient in _EXP_POLY[1:]:
        y = y * f + _f32(coefficient)
    y = y * f * f + f + _f32(1.0)
    exponent = tirx.shift_left(tirx.Cast("int32", n + _f32(126.0)), tirx.const(23, "int32"))
    result = y * tirx.reinterpret("float32", exponent) * _f32(2.0)
    # Above the range, and for NaN: arg + inf is +inf, or NaN, as expf gives.
    return tirx.Select(arg <= _f32(_EXP_HI), result, arg + _f32(float("inf")))


def _sigmoid_float32(arg):
    return _f32(1.0) / (_f32(1.0) + _exp_float32(-arg))


def vectorizable_math_pass() -> tvm.transform.Pass:
    """Rewrite the float32 erf / exp / sigmoid blocks of every unscheduled TIR function."""

    @tvm.transform.module_pass(opt_level=0, name="jitserve_vectorizable_math")
    def _rewrite(mod: tvm.ir.IRModule, _ctx) -> tvm.ir.IRModule:
        rewritten = {}
        for global_var, func in mod.functions_items():
            if isinstance(func, tirx.PrimFunc) and not (func.attrs and func.attrs.get("tirx.is_scheduled")):
                sch = s_tir.Schedule(func)
                if _vectorizable_math(sch):
                    rewritten[global_var] = sch.mod["main"]
        if not rewritten:
            return mod
        mod = mod.clone()  # passes must not change their input
        for global_var, func in rewritten.items():
            mod.update_func(global_var, func)
        return mod

    return _rewrite


def _vectorizable_math(sch: s_tir.Schedule) -> bool:
    """Replace float32 ``B[i] = erf(A[i])`` / ``exp`` / ``sigmoid`` blocks by polynomials.

    LLVM has no vector erf (each element calls libm's erff: GELU's erf cost 4x its matmul)
    and turns a vector exp into one expf call per lane. The polynomials vectorize.
    Returns whether a block was rewritten.
    """
    changed = False
    rewrites = {
        tvm.ir.Op.get("tirx.erf"): _erf_float32,
        tvm.ir.Op.get("tirx.exp"): _exp_float32,
        tvm.ir.Op.get("tirx.sigmoid"): _sigmoid_float32,
    }
    for block_rv in _root_blocks(sch):
        block = sch.get(block_rv)
        store = block.body
        if not isinstance(store, tirx.BufferStore) or block.init is not None:
            continue
        call = store.value
        if not isinstance(call, tvm.ir.Call) or str(call.ty) != "float32":
            continue
        rewrite = next((f for op, f in rewrites.items() if call.op.same_as(op)), None)
        if rewrite is None:
            continue
        body = tirx.BufferStore(store.buffer, rewrite(call.args[0]), store.indices)
        new_block = s_tir.SBlock(
            block.iter_vars,
            block.reads,
            block.writes,
            block.name_hint,
            body,
            None,
            block.alloc_buffers,
            block.match_buffers,
            block.annotations,
        )
        sch.state.replace(sch.get_sref(block_rv), new_block, {block: new_block})
        changed = True
    return changed


# --------------------------------------------------------------------------- common helpers


def _vector_lanes(target: Target, dtype: str) -> int:
    """SIMD lanes for ``dtype`` on ``target`` (16 float32 lanes with AVX-512)."""
    try:
        from tvm.target.codegen import llvm_get_vector_width

        bits = int(llvm_get_vector_width(target))
    except Exception:  # noqa: BLE001 - an LLVM without the query: assume SSE
        bits = 128
    return max((bits if bits > 0 else 128) // tvm.DataType(dtype).bits, 1)


def _num_cores(target: Target) -> int:
    cores = target.attrs.get("num-cores", None)
    return int(cores) if cores else 1


def _extent(sch: s_tir.Schedule, loop: LoopRV) -> int | None:
    value = sch.get(loop).extent
    return int(value) if isinstance(value, tirx.IntImm) else None


def _root_blocks(sch: s_tir.Schedule) -> list[SBlockRV]:
    return list(sch.get_child_blocks(sch.get_sblock("root")))


def _block_names(sch: s_tir.Schedule) -> list[str]:
    return [sch.get(b).name_hint for b in _root_blocks(sch)]


def _is_spatial(sch: s_tir.Schedule, block: SBlockRV) -> bool:
    return all(iv.iter_type == tirx.IterVar.DataPar for iv in sch.get(block).iter_vars)


def _trivially_bound(sch: s_tir.Schedule, block: SBlockRV) -> bool:
    """Each block iter bound to its own loop, in loop order, with the loop's constant extent."""
    loops = sch.get_loops(block)
    iter_vars = sch.get(block).iter_vars
    values = _get_sblock_realize(sch, block).iter_values
    if len(loops) != len(iter_vars):
        return False
    for loop_rv, iter_var, value in zip(loops, iter_vars, values, strict=True):
        loop = sch.get(loop_rv)
        if not value.same_as(loop.loop_var) or not isinstance(loop.extent, tirx.IntImm):
            return False
        if not isinstance(iter_var.dom.extent, tirx.IntImm) or int(iter_var.dom.extent) != int(loop.extent):
            return False
    return True


def _vars_of(expr) -> set:
    return set(tirx.analysis.undefined_vars(expr))


def _product(values) -> int:
    total = 1
    for value in values:
        total *= int(value)
    return total


def _depth(sch: s_tir.Schedule, loop: LoopRV) -> int:
    """The number of loops from the root down to ``loop``, itself included."""
    depth = 0
    sref = sch.get_sref(loop)
    while sref is not None and isinstance(sref.stmt, tirx.For):
        depth += 1
        sref = sref.parent
    return depth


def _pick_factor(extent: int, candidates: list[int]) -> int | None:
    """The first candidate that divides ``extent``."""
    return next((f for f in candidates if 0 < f <= extent and extent % f == 0), None)


def _total_elements(sch: s_tir.Schedule, block: SBlockRV) -> int:
    return _product(_extent(sch, loop) or 1 for loop in sch.get_loops(block))


def _vectorize_innermost(sch: s_tir.Schedule, block: SBlockRV, lanes: int, parallel: bool) -> None:
    """A spatial loop nest: vectorize (part of) the innermost loop, fuse the rest, maybe parallel."""
    loops = sch.get_loops(block)
    extents = [_extent(sch, loop) for loop in loops]
    if not loops or any(e is None for e in extents):
        return
    # A power-of-two divisor of the lanes' multiples; else a short loop whole; else scalar.
    factor = _pick_factor(extents[-1], [lanes * 2, lanes, lanes // 2, lanes // 4])
    if factor is None or factor < 4:
        factor = extents[-1] if extents[-1] <= lanes * 4 else (factor or 1)
    outer, inner = list(loops[:-1]), loops[-1]
    if 1 < factor < extents[-1]:
        split_outer, inner = sch.split(inner, factors=[None, factor])
        outer.append(split_outer)
    if factor > 1:
        sch.vectorize(inner)
    if outer:
        fused = sch.fuse(*outer) if len(outer) > 1 else outer[0]
        if parallel:
            sch.parallel(fused)


def _inline_injective(sch: s_tir.Schedule, keep: set[str] | None = None) -> None:
    """Inline every spatial block that can be (except ``keep``): into consumers, then producers."""
    keep = keep or set()
    changed = True
    while changed:
        changed = False
        for inline in (sch.compute_inline, sch.reverse_compute_inline):
            for block in _root_blocks(sch):
                if sch.get(block).name_hint in keep or not _is_spatial(sch, block):
                    continue
                try:
                    inline(block)
                except Exception:  # noqa: BLE001 - not inlinable: try the next block
                    continue
                changed = True
                break
            if changed:
                break
