"""Integer contractions: the ``integer_matmul`` product of :mod:`compiler.tvm.integer_matmul` (int16
activations by int16 weight panels, or uint8 by int8 ones, int32 sums), tensorized into the CPU's dot
product for them.

The product's tile of ``rows x panels`` (each panel 8 int32 columns) accumulates in registers over the
reduction, in groups of ``k`` (one ``vpmaddwd`` per row and panel for a pair of int16 ones; a
``vpmaddubsw`` and a ``vpmaddwd`` for four bytes), and is stored once; the tiles run in parallel. Its
epilogue (the zero point's correction, the dequantizing multiply, whatever was fused) is inlined into
the function's output, which is computed as a stage of its own, vectorized.
"""

from __future__ import annotations

from tvm import s_tir

from ..integer_matmul import INTEGER_MATMUL
from ..intrinsics import dot_intrinsic, registered
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


class IntegerContraction(SafeRule):
    """A function whose one reduction is an ``integer_matmul`` product on a CPU with AVX2."""

    def _schedule(self, func, target):
        from tvm.target.codegen import llvm_cpu_has_features

        if not llvm_cpu_has_features("avx2", target):
            return None
        sch = s_tir.Schedule(func)
        reductions = [b for b in root_blocks(sch) if not is_spatial(sch, b)]
        if len(reductions) != 1 or not sch.get(reductions[0]).name_hint.startswith(INTEGER_MATMUL):
            return None
        product = reductions[0]
        activation, weight = (region.source for region in sch.get(product).reads[:2])
        *lead, rows, panels, lanes, pair, within = sch.get_loops(product)
        depth = int(sch.get(within).extent)
        intrin = dot_intrinsic("avx2", str(activation.dtype), str(weight.dtype), depth)
        if intrin is None or int(sch.get(lanes).extent) != intrin.lanes:
            return None
        # The activation's producer stays a stage (a tensorized load reads a buffer), the rest inline.
        product_name = sch.get(product).name_hint
        keep = {product_name}
        keep.update(sch.get(b).name_hint for b in root_blocks(sch) if sch.get(b).writes[0].source.same_as(activation))
        inline_injective(sch, keep=keep)
        stages = [name for name in block_names(sch) if name != product_name]
        *lead, rows, panels, lanes, pair, within = sch.get_loops(product)
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
        sch.decompose_reduction(product, pair)
        sch.tensorize(lanes, registered(intrin, "local"))
        sch.unroll(rows_inner)
        sch.unroll(panels_inner)
        for name in stages:
            schedule_stage(sch, sch.get_sblock(name), target)
        sch.annotate(sch.get_sblock("root"), UNIT_ANNOTATION, f"int8 on {intrin.unit} ({intrin.instruction})")
        return sch
