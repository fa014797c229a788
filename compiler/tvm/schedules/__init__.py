"""Default schedules for LLVM targets, in the spirit of TVM's dlight.

Without them Relax emits naive loops on the CPU: nothing parallel, nothing
vectorized. Each rule matches a family of fused TIR functions and schedules
it; functions no rule matches stay as they are. A rule that is unsure, or
whose scheduling primitive fails, returns ``None``: the function then stays
naive but correct. Schedule primitives check their own preconditions, so a
schedule that applies computes what the naive loops compute.

- :class:`IntegerContraction` -- a quantized model's integer matmul, tensorized into the CPU's int8
  dot product (``compiler.tvm.integer_matmul``).
- :class:`Gemv` -- a contraction with one output row (a classifier at
  batch 1), its reduction summed in interleaved parts.
- :class:`Contraction` -- matmul, batch matmul, conv2d (incl. depthwise and
  padded), pooling, each with its fused producers and epilogue.
- :class:`RowReduction` -- softmax, layer norm, mean / global pooling, GEMV:
  blocks that share leading (row) axes.
- :class:`Injective` -- elementwise, broadcast, transpose, reshape, pad.

:func:`vectorizable_math_pass` runs before the rules (and before tuning
extracts its tasks): it replaces float32 ``erf`` / ``exp`` / ``sigmoid`` /
``tanh`` blocks by polynomials LLVM can vectorize. The rules themselves use traced
schedule primitives only, so a rule's schedule can be stored and replayed as
a tuning record.

One module per rule family, as in dlight; ``base`` holds what they share.
Runs in the compile child only (imports TVM).
"""

from __future__ import annotations

from .base import SymbolicBounds
from .contraction import Contraction
from .gemv import Gemv
from .injective import Injective
from .integer import IntegerContraction, IntegerConvContraction
from .math import vectorizable_math_pass
from .reduction import RowReduction

__all__ = [
    "Contraction",
    "Gemv",
    "Injective",
    "IntegerContraction",
    "IntegerConvContraction",
    "RowReduction",
    "SymbolicBounds",
    "default_cpu_rules",
    "vectorizable_math_pass",
]


def default_cpu_rules(symbolic_bounds: SymbolicBounds | None = None) -> list:
    """The rules, most specific first (dlight applies the first that matches); ``symbolic_bounds``:
    the ranges of the symbolic dims they may meet (a loop over one with no range stays naive).

    dlight's own ``cpu.GEMV`` and ``cpu.Reduction`` made PP-OCR cls 3x slower
    than no rules at all (measured: 3.9x -> 11.5x of ONNX Runtime at batch 1).
    """
    rules = (IntegerContraction, IntegerConvContraction, Gemv, Contraction, RowReduction, Injective)
    return [rule(symbolic_bounds) for rule in rules]
