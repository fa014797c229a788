"""What the contraction rule reads off its block before it schedules anything: which output axis is
vectorized, which is register-blocked (and whether loads are reused across it), which may tile a
second time, which are symbolic, and which iters index a producer plainly. No schedule primitive is
applied here."""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx

from .base import SBlockRV, extent_bound, trivially_bound, vars_of
from .gates import epilogues
from .register_tile import ContractionInfo

# Rows a register tile along an axis within one image (a map's columns, a sequence) needs to be preferred
# to one across the batch.
MIN_WITHIN_ROWS = 4


def analyze_contraction(sch: s_tir.Schedule, block: SBlockRV, padded: bool) -> ContractionInfo | None:
    stmt = sch.get(block)
    if len(stmt.writes) != 1 or not trivially_bound(sch, block):
        return None
    iter_vars = list(stmt.iter_vars)
    bounds = [extent_bound(iv.dom.extent) for iv in iter_vars]
    if any(b is None for b in bounds):
        return None
    extents = [int(b) for b in bounds]
    symbolic = frozenset(i for i, iv in enumerate(iter_vars) if not isinstance(iv.dom.extent, tirx.IntImm))
    multiple = {i: known_multiple(iter_vars[i].dom.extent) for i in symbolic}
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
    info = analyze_contraction(sch, main, padded)
    return None if info is None else (main, info)


def plain_iters(sch: s_tir.Schedule, main: SBlockRV, producer: str, info: ContractionInfo) -> list[int]:
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


def known_multiple(extent) -> int:
    """The largest number a symbolic extent is provably a multiple of (1 when none is known)."""
    known = tvm.sym.Analyzer().modular_set(extent)
    return int(known.coeff) if int(known.base) == 0 and int(known.coeff) > 0 else 1
