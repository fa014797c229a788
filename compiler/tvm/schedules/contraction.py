"""Contractions: matmul, batch matmul, conv2d (incl. depthwise and padded) and
pooling, each with its fused producers and epilogue, tiled into registers,
vectorized and run in parallel when large.

The rule is a sequence of named steps over one :class:`ContractionPlan`: what
``contraction_analysis`` reads off the block, then the choices (tiles, a packed
panel, where the pad is computed) and the schedule primitives that carry them out.
"""

from __future__ import annotations

import contextlib

from tvm import s_tir

from .base import (
    SafeRule,
    block_names,
    has_if_then_else,
    inline_injective,
    is_spatial,
    root_blocks,
)
from .contraction_plan import PER_CHANNEL_PAD_BYTES, ContractionPlan
from .gates import mark_broadcast
from .groups import split_group_blocks
from .loop_nest import LoopNest


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
        padded = inline_producers(sch, main_name)
        split_group_blocks(sch, main_name, PER_CHANNEL_PAD_BYTES)
        plan = ContractionPlan.analyze(sch, main_name, padded, target)
        if plan is None or (allow_pad and not plan.pad_to_whole_tiles()):
            return None
        plan.find_neighbours()
        plan.choose_tiles()
        plan.choose_panel()
        plan.choose_pad_placement()
        nest = LoopNest.build(plan)
        nest.parallelize()
        nest.accumulate_per_tile()
        nest.unroll_and_vectorize()
        nest.pack_panel()
        return nest.place_pads()


def inline_producers(sch: s_tir.Schedule, main_name: str) -> bool:
    """Plain-copy producers and injective stages inlined (a pad and a broadcast gate stay stages);
    whether the contraction reads a pad."""
    for name in block_names(sch):
        if name == main_name:
            break
        if not has_if_then_else(sch.get(sch.get_sblock(name))):  # a pad stays a stage
            with contextlib.suppress(Exception):
                sch.compute_inline(sch.get_sblock(name))
    names = block_names(sch)
    gate = mark_broadcast(sch, main_name)
    inline_injective(sch, keep=set(names[: names.index(main_name)]) | ({gate} if gate else set()))
    return any(has_if_then_else(sch.get(sch.get_sblock(name))) for name in names[: names.index(main_name)])
