"""Integer contractions: the ``integer_matmul`` product of :mod:`compiler.tvm.integer_matmul` (int16
activations by int16 weight panels, or uint8 by int8 ones, int32 sums) and the ``integer_conv`` one of
:mod:`compiler.tvm.integer_conv` (a channel-blocked int16 or uint8 map by int16 or int8 panels), and
their bf16 forms (:mod:`compiler.tvm.bf16`: bf16 operands, float32 sums), tensorized into the target's
dot product for them.

The product's tile of ``rows x panels`` (each panel 8 int32 columns) accumulates in registers over the
reduction, in groups of ``k`` (one ``vpmaddwd`` per row and panel for a pair of int16 ones; a
``vpmaddubsw`` and a ``vpmaddwd`` for four bytes), and is stored once; the tiles run in parallel. Its
epilogue (the zero point's correction, the dequantizing multiply, whatever was fused) is inlined into
the function's output, which is computed as a stage of its own, vectorized.
"""

from __future__ import annotations

from tvm import s_tir

from ..bf16 import BF16_CONV, BF16_LANES, BF16_MATMUL
from ..integer_conv import INTEGER_CONV
from ..integer_matmul import INTEGER_MATMUL
from ..intrinsics import best_dot_intrinsic, registered
from .base import (
    UNIT_ANNOTATION,
    SafeRule,
    block_names,
    inline_injective,
    is_spatial,
    root_blocks,
    schedule_stage,
    target_cores,
)
from .knobs import choose

# Accumulators of the tile (rows x panels): 8 of AVX2's 16 vector registers, leaving the panels' and
# the activation's; the largest that divides, and more as tuning's alternatives (4x3 and 6x2 measured no
# faster on BERT-base's 128 x 768 x 3072).
_ROWS = (4, 3, 2, 1)
_PANELS = (2, 1)
_ROW_CHOICES = (*_ROWS, 6)
_PANEL_CHOICES = (*_PANELS, 3, 4)


def _divisor(extent: int, candidates: tuple[int, ...]) -> int:
    return next(c for c in candidates if extent % c == 0)


def _extent(sch, loop) -> int:
    return int(sch.get(loop).extent)


def _integer_product(sch, target, name: str, lanes_of=lambda _loops: (8,)):
    """The function's one reduction where it is a ``name`` product on a CPU with AVX2, with the fastest
    intrinsic for its operands that the target has (VNNI's where present; ``lanes_of`` its loops: the
    widths it may take); its epilogue inlined (the activation's producer stays a stage: a tensorized load
    reads a buffer). None where the rule does not apply."""
    from tvm.target.codegen import llvm_cpu_has_features

    if not llvm_cpu_has_features("avx2", target):
        return None
    reductions = [b for b in root_blocks(sch) if not is_spatial(sch, b)]
    if len(reductions) != 1 or not sch.get(reductions[0]).name_hint.startswith(name):
        return None
    product = reductions[0]
    activation, weight = (region.source for region in sch.get(product).reads[:2])
    loops = sch.get_loops(product)
    depth = int(sch.get(loops[-1]).extent)
    intrin = best_dot_intrinsic(target, str(activation.dtype), str(weight.dtype), depth, lanes_of(loops))
    if intrin is None:
        return None
    product_name = sch.get(product).name_hint
    keep = {product_name}
    keep.update(sch.get(b).name_hint for b in root_blocks(sch) if sch.get(b).writes[0].source.same_as(activation))
    inline_injective(sch, keep=keep)
    return product, intrin, [name for name in block_names(sch) if name != product_name]


def _finish(sch, target, product, reduction, intrin, *, stages, tensorized, unrolled) -> None:
    """Sums initialized before the tile's outermost ``reduction`` loop, the innermost lanes tensorized,
    the tile unrolled, the other stages scheduled, and the unit named."""
    sch.decompose_reduction(product, reduction)
    sch.tensorize(tensorized, registered(intrin, "local"))
    for loop in unrolled:
        sch.unroll(loop)
    for name in stages:
        schedule_stage(sch, sch.get_sblock(name), target)
    precision = "bf16" if intrin.accumulator == "float32" else "int8"
    sch.annotate(sch.get_sblock("root"), UNIT_ANNOTATION, f"{precision} on {intrin.unit} ({intrin.instruction})")


class IntegerContraction(SafeRule):
    """A function whose one reduction is an ``integer_matmul`` product on a CPU with AVX2, or a
    ``bf16_matmul`` one (:mod:`compiler.tvm.bf16`, 16-lane panels) on one with AVX512-BF16."""

    def _schedule(self, func, target):
        sch = s_tir.Schedule(func)
        found = _integer_product(sch, target, INTEGER_MATMUL) or _integer_product(
            sch, target, BF16_MATMUL, lambda _loops: (BF16_LANES,)
        )
        if found is None:
            return None
        product, intrin, stages = found
        *lead, rows, panels, lanes, pair, within = sch.get_loops(product)
        if int(sch.get(lanes).extent) != intrin.lanes:
            return None
        extents = [int(sch.get(loop).extent) for loop in (rows, panels)]
        tile_rows = int(choose("integer.tile_rows", _divisor(extents[0], _ROWS), _ROW_CHOICES))
        tile_panels = int(choose("integer.tile_panels", _divisor(extents[1], _PANELS), _PANEL_CHOICES))
        if extents[0] % tile_rows or extents[1] % tile_panels:
            return None
        rows_outer, rows_inner = sch.split(rows, [None, tile_rows])
        panels_outer, panels_inner = sch.split(panels, [None, tile_panels])
        # Panels outermost: a panel's weights stay in cache while every row of every batch item reads them
        # (a batch outermost streamed all the weights once per item: BERT-base 8x128 2.3x ONNX Runtime).
        sch.reorder(panels_outer, *lead, rows_outer, pair, rows_inner, panels_inner, lanes, within)
        accumulators = sch.cache_write(product, 0, "local")
        sch.reverse_compute_at(accumulators, rows_outer)
        # Parallel before tensorizing: a tensorized block is opaque to the parallel primitive's checks.
        outer = sch.fuse(panels_outer, *lead, rows_outer)
        if target_cores(target) > 1:
            sch.parallel(outer)
        *_, stored = sch.get_loops(accumulators)
        sch.vectorize(stored)
        _finish(
            sch, target, product, pair, intrin, stages=stages, tensorized=lanes, unrolled=(rows_inner, panels_inner)
        )
        return sch


# The conv's register tile: output columns x blocks of output channels (each block b/lanes vectors). Four
# columns by two blocks where the row allows (one broadcast of a channel group feeds two dot products),
# else seven by one (ResNet's 14- and 7-wide maps). On ResNet-50's int16 convs (AMD EPYC Zen 3, AVX2)
# 2x2, 4x2, 7x1 and 2x4 measured within noise of each other: tuning's alternatives.
_COLUMN_CHOICES = (4, 7, 6, 5, 3, 2, 1, 8)
_BLOCK_CHOICES = (2, 1, 4)


def _conv_tile(width: int, blocks: int, vectors: int, accumulators: int = 8) -> tuple[int, int]:
    """(columns, blocks) of the register tile, of at most ``accumulators`` accumulators (``vectors`` each a
    block): AVX2's 8, the first that fits; AVX-512's 16, the most that fit, the earlier choices first among
    equals (ResNet-50 in bf16 on an AMD EPYC Zen 4: 4x4 and 7x2 tiles, 22.5 ms; the 8-accumulator tiles,
    33.7)."""
    fits = [
        (columns, count)
        for columns in _COLUMN_CHOICES
        for count in _BLOCK_CHOICES
        if width % columns == 0 and blocks % count == 0 and columns * count * vectors <= accumulators
    ]
    if accumulators > 8:
        return max(fits, key=lambda tile: tile[0] * tile[1], default=(1, 1))
    return fits[0] if fits else (1, 1)


class IntegerConvContraction(SafeRule):
    """A function whose one reduction is an ``integer_conv`` product on a CPU with AVX2, or a ``bf16_conv``
    one (:mod:`compiler.tvm.bf16`) on one with AVX512-BF16."""

    def _schedule(self, func, target):
        sch = s_tir.Schedule(func)

        def widths(loops) -> tuple[int, ...]:
            # AVX-512's 16-channel blocks take 16-lane products where the unit has them (zmm).
            return (8, 16) if _extent(sch, loops[4]) % 16 == 0 else (8,)

        found = _integer_product(sch, target, INTEGER_CONV, widths) or _integer_product(sch, target, BF16_CONV, widths)
        if found is None:
            return None
        product, intrin, stages = found
        batch, blocks, row, column, channel, in_block, kernel_h, kernel_w, pair, within = sch.get_loops(product)
        width, block_count, block = (int(sch.get(loop).extent) for loop in (column, blocks, channel))
        if block % intrin.lanes:
            return None
        # AVX-512's 32 registers hold 16 accumulators and the operands feeding them; AVX2's 16, 8.
        default = _conv_tile(width, block_count, block // intrin.lanes, 16 if intrin.lanes == 16 else 8)
        columns = int(choose("integer.conv_columns", default[0], _COLUMN_CHOICES))
        count = int(choose("integer.conv_blocks", default[1], _BLOCK_CHOICES))
        if width % columns or block_count % count:
            return None
        columns_outer, columns_inner = sch.split(column, [None, columns])
        blocks_outer, blocks_inner = sch.split(blocks, [None, count])
        vectors, lanes = sch.split(channel, [None, intrin.lanes])
        # Blocks of output channels outermost: their weights stay in cache across the map's rows.
        sch.reorder(blocks_outer, batch, row, columns_outer, in_block, kernel_h, kernel_w, pair,
                    blocks_inner, columns_inner, vectors, lanes, within)  # fmt: skip
        accumulators = sch.cache_write(product, 0, "local")
        sch.reverse_compute_at(accumulators, columns_outer)
        outer = sch.fuse(blocks_outer, batch, row)
        if target_cores(target) > 1:
            sch.parallel(outer)
        *_, stored = sch.get_loops(accumulators)
        sch.vectorize(stored)
        _finish(
            sch, target, product, in_block, intrin,
            stages=stages, tensorized=lanes, unrolled=(blocks_inner, columns_inner, vectors),
        )  # fmt: skip
        return sch
