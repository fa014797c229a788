"""Static shapes of Relax expressions, as the graph rewrites read them.

Runs in the compile child only (imports TVM).
"""

from __future__ import annotations

import tvm
from tvm import relax


def static_shape(expr: relax.Expr) -> list[int] | None:
    """``expr``'s tensor shape as integers, or ``None`` where it is unknown or any dim is symbolic."""
    shape = getattr(getattr(expr, "ty", None), "shape", None)
    dims = list(shape.values) if shape is not None and hasattr(shape, "values") else None
    if dims is None or not all(isinstance(d, tvm.tirx.IntImm) for d in dims):
        return None
    return [int(d) for d in dims]
