"""Injective functions: elementwise, broadcast, transpose, reshape, pad, concat."""

from __future__ import annotations

from tvm import s_tir

from .base import (
    SafeRule,
    inline_injective,
    is_spatial,
    root_blocks,
    schedule_stage,
    trivially_bound,
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
                schedule_stage(sch, block, target)
        return sch
