"""A contraction's result broadcast onto a larger map: squeeze-excitation's gate (a 1x1 conv on the pooled
map, its bias and sigmoid or hard sigmoid) multiplied into every position of the map it scales.

Inlined whole into the multiply, the gate's bias and sigmoid were computed again at every position, and
the multiply ran where the tiny conv did, on one core: RegNetY-800MF's gates at batch 8 ran 1.22-1.88x
ONNX Runtime's time on the same nodes, and 0.70-1.16x kept apart (EfficientNet-B0's at batch 1: 0.38-1.38x,
then 0.47-0.90x; AMD EPYC Zen 3, AVX2). Kept apart, the gate is computed once per channel as the conv's
epilogue, and the multiply is a stage of its own, vectorized and parallel where large."""

from __future__ import annotations

from tvm import s_tir, tirx

from .base import STAGE_ANNOTATION, block_names, is_spatial, product_of

# A consumer writing at least this many times the contraction's elements broadcasts its result.
MIN_BROADCAST = 8


def mark_broadcast(sch: s_tir.Schedule, main_name: str) -> str | None:
    """Annotate the block that broadcasts the contraction ``main_name``'s result as a stage of its own, and
    return the name of the gate it reads (the one block between them), which the caller keeps from being
    inlined into it; ``None`` (and nothing annotated) where the result is not broadcast so."""
    size = _elements(sch.get(sch.get_sblock(main_name)))
    if size is None:
        return None
    after = _after(sch, main_name)
    for at, name in enumerate(after):
        block = sch.get_sblock(name)
        if not is_spatial(sch, block) or (_elements(sch.get(block)) or 0) < MIN_BROADCAST * size:
            continue
        gates = [sch.get(p).name_hint for p in sch.get_producers(block) if sch.get(p).name_hint in after[:at]]
        if len(gates) != 1:
            return None
        sch.annotate(block, STAGE_ANNOTATION, True)
        return gates[0]
    return None


def epilogues(sch: s_tir.Schedule, main_name: str) -> list[str]:
    """The blocks after the contraction ``main_name`` that are not stages of their own."""
    return [name for name in _after(sch, main_name) if not _stage(sch, name)]


def stages_after(sch: s_tir.Schedule, main_name: str) -> list[str]:
    return [name for name in _after(sch, main_name) if _stage(sch, name)]


def _after(sch: s_tir.Schedule, main_name: str) -> list[str]:
    names = block_names(sch)
    return names[names.index(main_name) + 1 :]


def _stage(sch: s_tir.Schedule, name: str) -> bool:
    return STAGE_ANNOTATION in sch.get(sch.get_sblock(name)).annotations


def _elements(stmt) -> int | None:
    shape = stmt.writes[0].source.shape if len(stmt.writes) == 1 else None
    if shape is None or not all(isinstance(d, tirx.IntImm) for d in shape):
        return None
    return product_of(shape)
