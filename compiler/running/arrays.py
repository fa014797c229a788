"""Seeded test inputs and output comparison, shared by verification and the
padding-safety check."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np


def contiguous(array: np.ndarray) -> np.ndarray:
    """A C-contiguous array of the same shape: ``np.ascontiguousarray`` turns a 0-d array into a 1-d one."""
    return np.require(array, requirements="C")


def random_array(shape: tuple[int, ...], dtype: str, rng: np.random.Generator, high: int = 8) -> np.ndarray:
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    if np.issubdtype(np.dtype(dtype), np.integer):
        # Small non-negative values stay valid as indices (token ids, gathers).
        return rng.integers(0, max(1, min(8, high)), size=shape).astype(dtype)
    return rng.standard_normal(size=shape).astype(dtype)


def random_inputs(
    shapes: dict[str, tuple[int, ...]],
    dtypes: dict[str, str],
    seed: int,
    index_limits: dict[str, int] | None = None,
) -> dict[str, np.ndarray]:
    """Seeded inputs; an integer input that indexes a dimension of size n (``index_limits``) stays below n."""
    rng = np.random.default_rng(seed)
    limits = index_limits or {}
    return {name: random_array(tuple(shape), dtypes[name], rng, limits.get(name, 8)) for name, shape in shapes.items()}


QUANTIZED_SHARE = 0.999
"""Of a dequantized output's elements, the share two engines' int8 kernels must agree on within one
quantization step (where they round an element differently, they are one step apart)."""


@dataclass(frozen=True)
class Comparison:
    matches: bool
    max_abs_error: float
    worst_output: str | None
    detail: str


def _nan_mismatches(got: np.ndarray, want: np.ndarray) -> int:
    """Places where exactly one of two float arrays is NaN (the largest difference ignores them)."""
    if got.dtype.kind not in "fc" and want.dtype.kind not in "fc":
        return 0
    return int(np.count_nonzero(np.isnan(got.astype(np.float64)) != np.isnan(want.astype(np.float64))))


def tolerances_for(dtype: str, rtol: float, atol: float) -> tuple[float, float]:
    """float16 carries ~3 decimal digits: never ask more of it than that."""
    if dtype == "float16":
        return max(rtol, 1e-2), max(atol, 1e-2)
    return rtol, atol


def compare_outputs(
    actual: dict[str, np.ndarray],
    expected: dict[str, np.ndarray],
    rtol: float,
    atol: float,
    *,
    steps: Mapping[str, float] | None = None,
) -> Comparison:
    """Whether ``actual`` answers as ``expected`` within the tolerances. An output with a quantization step
    in ``steps`` (dequantized from int8) matches where :data:`QUANTIZED_SHARE` of its
    elements are within one step (and ``atol``): int8 kernels may round an element one step apart."""
    worst_error, worst_name, problems, notes = 0.0, None, [], []
    for name, want in expected.items():
        got = actual.get(name)
        if got is None:
            problems.append(f"output {name!r} missing")
            continue
        if got.shape != want.shape:
            problems.append(f"output {name!r} has shape {got.shape}, expected {want.shape}")
            continue
        step = (steps or {}).get(name)
        if want.dtype == bool or np.issubdtype(want.dtype, np.integer):
            error = float(np.max(np.abs(got.astype(np.int64) - want.astype(np.int64)), initial=0))
            close = error == 0
        else:
            diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
            error = float(np.nanmax(diff, initial=0.0))
            r, a = tolerances_for(str(want.dtype), rtol, atol)
            close = bool(np.allclose(got, want, rtol=r, atol=a, equal_nan=True))
            if step is not None and not close and not _nan_mismatches(got, want):
                within = float(np.mean(diff <= step * (1 + 1e-6) + a)) if diff.size else 1.0
                close = within >= QUANTIZED_SHARE
                notes.append(f"output {name!r} within one quantization step ({step:.3g}) on {within:.2%} of elements")
        if error >= worst_error:
            worst_error, worst_name = error, name
        if not close:
            nan = _nan_mismatches(got, want)
            differs = [f"differs by up to {error:.3g}"] if error or not nan else []
            differs += [f"has NaN in {nan} places where the other has a number"] if nan else []
            problems.append(f"output {name!r} {' and '.join(differs)}")
    if problems:
        return Comparison(False, worst_error, worst_name, "; ".join(problems + notes))
    return Comparison(True, worst_error, worst_name, f"ok ({'; '.join(notes)})" if notes else "ok")
