"""A contraction's register tile: what the contraction rule analyzed (its iters' roles) and how many of
each iter the tile holds, planned from the target's vector unit."""

from __future__ import annotations

from dataclasses import dataclass, field

from .base import ACCUMULATOR_VECTORS_NO_REUSE, VectorUnit, pick_factor, product_of, symbolic_tile


@dataclass
class ContractionInfo:
    spatial: list[int]  # positions of the spatial iters in the block's iter list
    reduce: list[int]
    vec: int  # the vectorized iter: innermost non-unit output axis
    reg: int | None  # the register-blocked iter
    reuse: bool  # whether the vector-loaded operands are shared across ``reg``
    extents: list[int]  # a symbolic extent at its largest value
    symbolic: frozenset[int] = frozenset()  # iters whose extent is symbolic
    multiple: dict[int, int] = field(default_factory=dict)  # a symbolic extent -> a number it is a multiple of
    # An iter the vector-loaded operands use and the broadcast ones do not (a channel-blocked conv's output
    # channel block): unrolled beside ``reg`` where the vector axis is one vector, so that each broadcast
    # value feeds several vector FMAs.
    outer: int | None = None
    # Whether the register-blocked axis may end in a partial tile (``ragged_outer_tile``): a padded conv
    # (computed on a few padded columns before) or a 1x1 one, not a conv over its input as it is.
    exact_width: bool = False


# A shorter reduction keeps one vector a row. It was 256 while each tile streamed its weights from L2
# (ResNet-50's 1x1 64 -> 256 conv at 56x56 ran 2.90 ms (x3) as 1 x 8 and 4.07 as 2 x 4); with the weights
# chunked into L1 (contraction.py), 32 made MobileNetV3 4% and EfficientNet-B0 5% faster at batch 1 and
# no zoo or PP-OCR model slower (AMD EPYC Zen 3, AVX2).
MIN_OUTER_TILE_REDUCTION = 32


def outer_tile(info: ContractionInfo, lanes: int, nr: int, mr: int, unit: VectorUnit) -> tuple[int, int]:
    """``(ov, mr)``: ``ov`` of ``info.outer`` by ``mr`` of the register-blocked axis, when the vector tile is
    one vector (a channel-blocked conv: ``ov`` output channel blocks by ``mr`` output columns; see
    ``best_outer_tile``). ResNet-50 at 1x3x224x224 ran 71.6 ms with one vector a row and 66.6 with these
    (AMD EPYC Zen 3, AVX2)."""
    if not _tiles_outer(info, nr, lanes):
        return 1, mr
    _, ov, rows = best_outer_tile(info.extents[info.reg], info.extents[info.outer], unit)
    return ov, rows


def ragged_outer_tile(info: ContractionInfo, lanes: int, nr: int, unit: VectorUnit) -> tuple[int, int] | None:
    """``(ov, mr)`` of a better tile than ``outer_tile``'s whose ``mr`` does not divide the register-blocked
    axis (``padded_conv_width``), where the reduction is taken in chunks (``reduction_chunk``): the axis's
    loop is then its own, under the chunk loop, and the contraction rule peels its last, partial tile off
    (a loop of whole tiles and a loop of one, whose guards their bounds decide). ``None`` where the best
    tile divides the axis, or the reduction is not chunked: the axis's loop would then hold the tile's
    init and epilogue too, and TVM's ``loop_partition`` crashed the compile on such a loop (ResNet-50's
    1x1 64-channel conv at 56x56)."""
    if not _tiles_outer(info, nr, lanes):
        return None
    partial = _partial_tile(info, info.extents[info.reg], lanes, unit)
    return None if partial is None else partial[1:]


def _partial_tile(info: ContractionInfo, columns: int, lanes: int, unit: VectorUnit) -> tuple[float, int, int] | None:
    """``(efficiency counted over the real columns, ov, rows)`` of the tile planned on ``columns`` padded to
    whole tiles, where its last tile would be partial and the reduction is chunked; else ``None``."""
    blocks = info.extents[info.outer]
    width = padded_conv_width(columns, blocks, unit)
    if width == columns:
        return None
    efficiency, ov, rows = best_outer_tile(width, blocks, unit)
    if rows >= columns or not columns % rows or reduction_chunk(info, ov, lanes) is None:
        return None
    return efficiency * columns / width, ov, rows


def _tile_estimate(info: ContractionInfo, columns: int, lanes: int, unit: VectorUnit) -> float:
    """``best_outer_tile``'s estimate over ``columns`` positions, or a partial tile's where one applies."""
    estimate = best_outer_tile(columns, info.extents[info.outer], unit)[0]
    partial = _partial_tile(info, columns, lanes, unit)
    return estimate if partial is None else max(estimate, partial[0])


def _tiles_outer(info: ContractionInfo, nr: int, lanes: int) -> bool:
    reduction = product_of(info.extents[p] for p in info.reduce)
    return (
        info.outer is not None
        and nr == lanes
        and info.reg is not None
        and info.reg not in info.symbolic
        and reduction >= MIN_OUTER_TILE_REDUCTION
    )


# Independent FMA chains two FMA ports need in flight: an FMA's latency (4 on Zen 3) and one for the
# loads feeding it, times two. Estimated with 8, an 8-accumulator tile (2 x 4 or 4 x 2) was as fast as
# 4 x 3, but on a 12-wide map 4 x 3 ran 0.89-1.02x of their time (0.95 on average; 3x3 convs over 128,
# 256 and 512 channels), and on a 7x7 map 4 x 3 over 9 padded columns ran 0.86-1.0x the time of 1 x 7
# (0.92 on average over five runs; AMD EPYC Zen 3, AVX2).
FMA_CHAINS = 10


def tile_efficiency(ov: int, rows: int) -> float:
    """The estimated share of the FMA ports an ``ov x rows`` tile keeps busy. Each step of the reduction
    loads ``ov`` weight vectors (from L2 when they outgrow L1) and broadcasts ``rows`` values for
    ``ov * rows`` FMAs: its cycles are the most of the FMAs over two ports, the loads over two ports and
    one cycle per weight vector (L2 to L1); and the FMAs are held back where the tile has fewer
    accumulators than ``FMA_CHAINS``. MLAS's AVX2 NCHWc kernel runs 4 x 3 tiles."""
    fmas = ov * rows / 2
    return fmas / max(fmas, (ov + rows) / 2, float(ov)) * min(1.0, ov * rows / FMA_CHAINS)


def fits_registers(ov: int, rows: int, registers: int) -> bool:
    """Whether an ``ov x rows`` tile's accumulators and its broadcast rows (each read by ``ov`` FMAs, so all
    live at once where ``ov > 1``) fit the register file; a weight vector can be an FMA's memory operand.
    A 2 x 6 tile on AVX2's 16 registers (18 needed) spilled its broadcasts to the stack and ran 1.19-1.31x
    the time of 4 x 3 on 12-wide maps (AMD EPYC Zen 3)."""
    return ov * rows + (rows if ov > 1 else 1) <= registers


def best_outer_tile(columns: int, blocks: int, unit: VectorUnit) -> tuple[float, int, int]:
    """``(efficiency, ov, rows)`` of the best ``ov x rows`` tile over ``blocks`` output channel blocks and
    ``columns`` positions, each a divisor, that fits the registers (``tile_efficiency``); on a tie, the one
    reusing each weight vector most."""
    best = (0.0, 0, 0, 1, 1)
    budget = unit.accumulators
    for rows in range(1, budget + 1):
        if columns % rows:
            continue
        for ov in range(1, budget // rows + 1):
            if blocks % ov or not fits_registers(ov, rows, unit.registers):
                continue
            best = max(best, (round(tile_efficiency(ov, rows), 3), rows, ov * rows, ov, rows))
    return best[0], best[3], best[4]


def padded_conv_width(columns: int, blocks: int, unit: VectorUnit) -> int:
    """The width, in whole tiles, a channel-blocked conv's tile is planned on: ``columns`` rounded up to
    where the best tile's efficiency, counted over the real columns only, is highest (``columns`` itself
    on a tie). The conv computes its real columns only, its last tile partial (``ragged_outer_tile``).

    ResNet's maps (56, 28, 14, 7) have no factor 3, so no 4 x 3 tile: 8 accumulators, or 1 x 7 on the 7x7
    map. Computed on 9 padded columns, ResNet-50's 3x3 512-channel conv on it ran 0.86-1.0x its time (0.92
    on average over five runs), and on 7 with the last tile partial 0.86-0.90x of that again; the 1x1 ones
    over the map's 49 positions 0.78-0.89x of 1 x 7 (AMD EPYC Zen 3, AVX2).
    """
    best_width, best = columns, best_outer_tile(columns, blocks, unit)[0]
    for width in range(columns + 1, columns + unit.accumulators):
        efficiency = best_outer_tile(width, blocks, unit)[0] * columns / width
        if efficiency > best + 1e-9:
            best_width, best = width, efficiency
    return best_width


def flattening_pays(info: ContractionInfo, lanes: int, unit: VectorUnit, flattened: int) -> bool:
    """Whether a channel-blocked conv's tile estimate improves with its columns' axis ``flattened`` to
    ``flattened`` positions (its rows and columns as one: see ``flat_map.py``)."""
    _, nr = tile_sizes(info, lanes, unit.accumulators)
    if not _tiles_outer(info, nr, lanes):
        return False
    return _tile_estimate(info, flattened, lanes, unit) > _tile_estimate(info, info.extents[info.reg], lanes, unit)


# A padded row tile may compute at most this share of rows past the extent.
MAX_ROW_PADDING = 0.15


def padded_rows(info: ContractionInfo, lanes: int, accumulators: int) -> int | None:
    """Rows of a register tile the register-blocked axis is padded to whole tiles of, when none of its
    divisors fills half the budget (ConvNeXt's 7x7 stage: 49 rows ran as 1 x 16, at an FMA's latency);
    ``None`` when a divisor does, or padding would waste more than ``MAX_ROW_PADDING``. Matmuls only: a
    channel-blocked conv's tile is filled by its output channel blocks (a matmul's column panels, wider
    than one vector, fill none: ``outer_tile``)."""
    if info.reg is None or not info.reuse or info.reg in info.symbolic:
        return None
    mr, nr = tile_sizes(info, lanes, accumulators)
    if info.outer is not None and nr == lanes:
        return None
    budget = max(1, accumulators // max(1, -(-nr // lanes)))
    extent = info.extents[info.reg]
    if extent <= budget or 2 * mr > budget:
        return None
    padded = {rows: -(-extent // rows) * rows for rows in range(budget // 2 + 1, budget + 1)}
    rows = min(padded, key=lambda r: (padded[r], -r))
    return rows if padded[rows] <= extent * (1 + MAX_ROW_PADDING) else None


def tile_sizes(info: ContractionInfo, lanes: int, accumulators: int) -> tuple[int, int]:
    """Register tile: ``mr`` rows of the register-blocked axis by ``nr`` lanes of the vector axis.

    ``nr`` is a power-of-two number of vectors (or a part of one): LLVM spills odd-sized
    vectors (48 lanes ran 3x slower than 32 in a depthwise conv). A symbolic axis
    needs no divisor (its tail is peeled, or padded away): whole vectors, and the full
    budget of rows, or a divisor of what a padded axis is a multiple of.
    """
    n = info.extents[info.vec]
    if info.vec in info.symbolic:  # a width padded to whole tiles (see legalize.py) splits without a tail
        multiple = info.multiple.get(info.vec, 1)
        nr = next((t for t in (lanes * 2, lanes) if multiple % t == 0), symbolic_tile(n, lanes))
    else:
        nr = pick_factor(n, [lanes * 2, lanes, lanes * 4, lanes // 2, lanes // 4]) or 1
    if info.reg is None:
        return 1, nr
    vectors = max(1, -(-nr // lanes))
    budget = max(1, (accumulators if info.reuse else ACCUMULATOR_VECTORS_NO_REUSE) // vectors)
    if info.reg in info.symbolic:
        multiple = info.multiple.get(info.reg, 1)
        if multiple > 1:
            return pick_factor(multiple, list(range(budget, 0, -1))) or 1, nr
        return max(1, min(budget, info.extents[info.reg])), nr
    return pick_factor(info.extents[info.reg], list(range(budget, 0, -1))) or 1, nr


# Weights one chunk of a channel-blocked conv's reduction may load: a quarter of a 32 KB L1, the rest
# for the input rows and the accumulators. Chunked so, ResNet-50 at batch 1 ran 57.1 ms against 64.1,
# DeepLabV3 22.4 against 28.2, no zoo or PP-OCR model slower (AMD EPYC Zen 3, AVX2; 16 KB chunks were
# up to 20% slower than 8 KB on single layers).
L1_WEIGHT_BYTES = 8 * 1024
# Reduction steps a chunk must give each accumulator, which it loads and stores once a chunk: a 1x1
# conv over a prime count of input channel blocks (MobileNetV3's 184 channels: 23) got chunks of one
# block, 8 steps, and ran 25% slower than streaming its weights from L2 (AMD EPYC Zen 3, AVX2).
MIN_CHUNK_STEPS = 32


def reduction_chunk(info: ContractionInfo, ov: int, lanes: int) -> int | None:
    """How many iterations of the outermost reduction loop (a blocked conv's input channel blocks) one
    pass over a row of register tiles takes, when a tile's weights outgrow ``L1_WEIGHT_BYTES``; ``None``
    when they fit (or the tile has no output channel blocks).

    Unchunked, every tile re-streams its ``ov`` blocks' whole weight slice from L2 (ResNet-50's 3x3
    256-channel conv: 295 KB per tile of 2 columns). Chunked, the row's tiles share each chunk from L1
    and add to accumulators kept in a row buffer, as ONNX Runtime's MLAS does per input channel block.
    """
    step = ov * lanes * 4  # weight bytes one reduction step loads
    inner = product_of(info.extents[p] for p in info.reduce[1:])
    head = info.extents[info.reduce[0]]
    if step * inner * head <= L1_WEIGHT_BYTES:
        return None
    divisors = [d for d in range(1, head + 1) if head % d == 0]
    chunk = max(d for d in divisors if d == 1 or step * inner * d <= L1_WEIGHT_BYTES)
    if inner * chunk < MIN_CHUNK_STEPS:
        # The shortest chunk that is long enough, or none where only the whole reduction is.
        chunk = min(d for d in divisors if inner * d >= MIN_CHUNK_STEPS or d == head)
    return None if chunk == head else chunk
