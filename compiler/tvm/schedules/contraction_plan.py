"""One contraction block being scheduled (:class:`ContractionPlan`): what ``contraction_analysis`` reads off the
block, and the choices each step of the rule makes (padding to whole tiles, the register tile, a packed
panel, where the pad is computed), each a knob a tuner may turn (:mod:`.knobs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tvm import s_tir

from .base import (
    SBlockRV,
    VectorUnit,
    block_names,
    product_of,
    target_cores,
    total_elements,
    vector_unit,
    whole_vector_tile,
)
from .contraction_analysis import main_contraction, plain_iters
from .flat_map import flatten_pointwise_map
from .gates import epilogues
from .knobs import choose
from .panel import packable_operand, panel_axes
from .register_tile import (
    ContractionInfo,
    outer_tile,
    padded_rows,
    ragged_outer_tile,
    tile_sizes,
)

# A depthwise conv's or pool's padded map per channel block past which its pad is computed per output
# row instead: half of a 512 KB L2 (EfficientNet's 32-channel 112x112 depthwise conv, 416 KB a block:
# 0.125 -> 0.086 ms per row; 108 KB ones ran 10-25% slower per row; AMD EPYC Zen 3, AVX2).
PER_CHANNEL_PAD_BYTES = 256 * 1024
# Whole vectors a vectorized axis must span before its ragged tail is padded away rather than computed in
# half vectors: at 8 the padding wastes at most 1/16 of the work.
PAD_TO_WHOLE_VECTORS_MIN = 8


@dataclass
class ContractionPlan:
    """One contraction block being scheduled: its analysis and the choices each step makes."""

    sch: s_tir.Schedule
    target: object
    main_name: str
    padded: bool
    unit: VectorUnit
    lanes: int
    main: SBlockRV
    info: ContractionInfo
    producers: list[str] = field(default_factory=list)
    after: list[str] = field(default_factory=list)
    mr: int = 1
    nr: int = 1
    ov: int = 1
    partial: tuple[int, int] | None = None
    packed: str | None = None
    panel_iters: list[int] = field(default_factory=list)
    per_channel: list[int] = field(default_factory=list)
    pad_rows: bool = False

    @classmethod
    def analyze(cls, sch: s_tir.Schedule, main_name: str, padded: bool, target) -> ContractionPlan | None:
        """The block's analysis, after a pointwise map is flattened into one axis where that pays."""
        found = main_contraction(sch, main_name, padded)
        if found is None:
            return None
        main, info = found
        unit = vector_unit(target)
        lanes = unit.lanes(str(sch.get(main).writes[0].source.dtype))
        plan = cls(sch, target, main_name, padded, unit, lanes, main, info)
        flatten = choose("contraction.flatten", True, (False,))  # where the rule finds it pays
        if flatten and flatten_pointwise_map(sch, main, info, lanes, unit) and not plan._reanalyze():
            return None
        return plan

    def _reanalyze(self) -> bool:
        found = main_contraction(self.sch, self.main_name, self.padded)
        if found is None:
            return False
        self.main, self.info = found
        return True

    def pad_to_whole_tiles(self) -> bool:
        """The computation padded to whole vectors and tiles where its extents are ragged or symbolic;
        False where the padded block no longer analyzes."""
        info, lanes, unit = self.info, self.lanes, self.unit
        n = info.extents[info.vec]
        # A symbolic axis of a matmul is padded to whole tiles too: a guard inside the accumulation ran
        # the last tile scalar (rec's 12 rows at width 100 in a 16-row tile: 0.69 against 0.29 ms).
        symbolic_vec = info.vec in info.symbolic
        symbolic_reg = info.reg is not None and info.reg in info.symbolic
        ragged = not symbolic_vec and n > lanes and whole_vector_tile(n, lanes) is None
        # A long axis only half vectors divide (ShuffleNet's 14x14 maps: 196 columns) is padded to whole ones
        # too: its 1x1 conv ran 295 us in half vectors and 167 padded to 200 (AMD EPYC Zen 3, AVX2).
        half_vectors = not symbolic_vec and n >= PAD_TO_WHOLE_VECTORS_MIN * lanes and n % lanes != 0
        alternatives = (True, False) if not symbolic_vec and n % lanes else ()
        ragged = bool(choose("contraction.pad_lanes", ragged or half_vectors, alternatives))
        rows = padded_rows(info, lanes, unit.accumulators)
        if not (symbolic_vec or symbolic_reg or ragged or rows):
            return True
        mr, nr = tile_sizes(info, lanes, unit.accumulators)
        padding = [1] * len(info.extents)
        padding[info.vec] = nr if symbolic_vec else lanes if ragged else 1
        if symbolic_reg or rows:
            padding[info.reg] = rows or mr
        self.sch.pad_einsum(self.main, padding)
        after = epilogues(self.sch, self.main_name)
        if len(after) > 1:  # the copy out of the padded result, then the epilogue
            self.sch.compute_inline(self.sch.get_sblock(after[0]))
        return self._reanalyze()

    def find_neighbours(self) -> None:
        """The stages before the contraction (pads) and its epilogue, as they stand now."""
        names = block_names(self.sch)
        self.producers = names[: names.index(self.main_name)]
        self.after = epilogues(self.sch, self.main_name)

    def choose_tiles(self) -> None:
        """The register tile (``mr`` x ``nr``), the tiles along the outer axis (``ov``) and whether the
        last of them is partial."""
        info, lanes, unit = self.info, self.lanes, self.unit
        mr, self.nr = tile_sizes(info, lanes, unit.accumulators)
        self.ov, self.mr = outer_tile(info, lanes, self.nr, mr, unit)
        # A tile whose last one is partial, not for a conv over its input as it is (ConvNeXt's 2x2
        # stride-2 384 -> 768 one onto a 7x7 map ran 1.09-1.28x the time of 1 x 7 so; AMD EPYC Zen 3, AVX2).
        self.partial = ragged_outer_tile(info, lanes, self.nr, unit) if info.exact_width else None
        if self.partial is not None:
            self.ov, self.mr = self.partial
        self._tile_knobs()

    def _tile_knobs(self) -> None:
        """The register tile's lanes and rows as knobs: whole divisors of constant extents only, within
        the register file (a tuner's alternatives to the rule's estimate)."""
        info, lanes = self.info, self.lanes
        if info.symbolic or self.partial is not None:
            return
        n = info.extents[info.vec]
        widths = [w for w in (lanes // 2, lanes, lanes * 2, lanes * 4) if w >= 1 and n % w == 0]
        self.nr = int(choose("contraction.nr", self.nr, widths))
        if info.reg is None:
            return
        vectors = max(1, -(-self.nr // lanes)) * self.ov
        budget = self.unit.accumulators // vectors if info.reuse else self.unit.accumulators
        extent = info.extents[info.reg]
        rows = [r for r in range(1, max(1, budget) + 1) if extent % r == 0][-4:]
        self.mr = int(choose("contraction.mr", self.mr, rows))

    def choose_panel(self) -> None:
        """A weight panel (A @ B: B's K x nr columns) packed once per column tile, reused by every row tile."""
        sch, info = self.sch, self.info
        if not info.symbolic and self.ov == 1:  # a padded matmul's producers pad its rows, not the panel's operand
            packed = packable_operand(sch, self.main, info, self.mr, self.nr, cores=target_cores(self.target))
            produced = {sch.get(sch.get_sblock(name)).writes[0].source.name for name in self.producers}
            self.packed = None if packed in produced else packed
        if self.packed is not None and not choose("contraction.pack_panel", True, (False,)):
            self.packed = None
        if self.packed is not None:
            self.panel_iters = panel_axes(sch.get(self.main), info, self.packed)

    def choose_pad_placement(self) -> None:
        """A single pad indexed by plain (batch, channel) axes is computed per channel (not a padded
        matmul's rows: its column tiles are the parallel loop), and per output row too where that pays."""
        sch, info = self.sch, self.info
        if len(self.producers) != 1 or self.packed is not None:
            return
        tiled = (info.vec, info.reg, info.outer)
        indexing_plainly = plain_iters(sch, self.main, self.producers[0], info)
        plain = [p for p in indexing_plainly if p not in tiled]
        shares = product_of(info.extents[p] for p in plain)
        # Per block of channel lanes (the vector indexes the pad plainly); NCHW pads one channel at a time.
        blocks = info.vec in indexing_plainly
        pad_bytes = total_elements(sch, sch.get_sblock(self.producers[0])) * 4 // max(1, shares) if blocks else 0
        # Not for a partial tile (its loop is chunked): with the pad per image and the chunked tiles
        # under it, ResNet-50 at batch 8 ran 1.10x the time of the build before; with the pad up
        # front, as at batch 1, 1.01x (AMD EPYC Zen 3, AVX2).
        cores = target_cores(self.target)
        if plain and shares >= 2 * cores and pad_bytes <= PER_CHANNEL_PAD_BYTES and not self.partial:
            self.per_channel = plain
        elif len(plain) >= 2:
            # A depthwise conv (or pool) with too few channel blocks to share out, or whose padded map
            # per channel block outgrows L2 (MobileNetV3's 16-channel 112x112 one: its pad was one serial
            # pass over the map, 4.9x ONNX Runtime's time): the pad is computed per output row too, as
            # the rows of taps that row reads.
            rows = [p for p in info.spatial if p not in tiled and p not in plain and info.extents[p] > 1]
            self.per_channel = plain + rows[:1] if rows else []
            self.pad_rows = bool(rows)
