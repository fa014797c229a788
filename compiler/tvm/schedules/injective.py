"""Injective functions: elementwise, broadcast, transpose, reshape, pad, concat."""

from __future__ import annotations

from tvm import s_tir

from .base import (
    PARALLEL_MIN_ELEMENTS,
    SafeRule,
    inline_injective,
    is_spatial,
    root_blocks,
    total_elements,
    trivially_bound,
    vector_lanes,
    vectorize_innermost,
)


class Injective(SafeRule):
    """Only spatial blocks (elementwise, broadcast, transpose, reshape, pad, concat):
    inline into the outputs, fuse each remaining loop nest, vectorize its innermost
    loop and run the rest in parallel when large."""

    def _schedule(self, func, target):
        sch = s_tir.Schedule(func)
        blocks = root_blocks(sch)
        if not blocks or not all(is_spatial(sch, b) for b in blocks):
            return None
        inline_injective(sch, bounded=True)
        for block in root_blocks(sch):
            if trivially_bound(sch, block):
                lanes = vector_lanes(target, str(sch.get(block).writes[0].source.dtype))
                parallel = total_elements(sch, block) >= PARALLEL_MIN_ELEMENTS
                vectorize_innermost(sch, block, lanes, parallel)
        return sch
