"""Padding-safety check: may this symbolic axis be padded up to a bucket?

ONNX Runtime runs a seeded random input at an exact size and the same input
padded along the axis. Every output axis that changes size must follow the
input axis 1:1 (so it can be cut back), and the cut-back outputs must match.
The batch axis of most models passes; spatial axes of CNNs (pooling sees the
padding) and unmasked sequence axes (attention sees it) fail.
"""

from __future__ import annotations

from .arrays import compare_outputs, random_inputs
from .buckets import AxisSafety, pad_inputs
from .engines import Engine
from .signature import Signature


def check_axis_padding(
    engine: Engine,
    signature: Signature,
    axis: str,
    sizes: dict[str, int],
    padded_size: int,
    *,
    pad_values: dict[str, float] | None = None,
    rtol: float = 1e-3,
    atol: float = 1e-4,
    seed: int = 0,
) -> AxisSafety:
    """Check ``axis`` at ``sizes[axis]`` padded to ``padded_size``.

    ``sizes`` gives a concrete size for every symbolic axis of the model.
    """
    size = sizes[axis]
    if padded_size <= size:
        raise ValueError(f"padded size {padded_size} must exceed the exact size {size}")

    def shapes_with(axis_size: int) -> dict[str, tuple[int, ...]]:
        concrete = dict(sizes, **{axis: axis_size})
        return {
            spec.name: tuple(d if isinstance(d, int) else concrete[d] for d in spec.dims) for spec in signature.inputs
        }

    dtypes = {spec.name: spec.dtype for spec in signature.inputs}
    exact_inputs = random_inputs(shapes_with(size), dtypes, seed)
    padded_inputs = pad_inputs(exact_inputs, shapes_with(padded_size), pad_values)
    try:
        exact = engine.run(exact_inputs)
        padded = engine.run(padded_inputs)
    except Exception as exc:  # noqa: BLE001 - the model itself rejects the shape
        return AxisSafety(axis=axis, safe=False, reason=f"model fails at the probe shape: {type(exc).__name__}: {exc}")

    output_axes: dict[str, list[int]] = {}
    cut = {}
    for name, want in exact.items():
        got = padded[name]
        if got.ndim != want.ndim:
            return AxisSafety(axis=axis, safe=False, reason=f"output {name!r} changes rank when padded")
        changed = [i for i, (a, b) in enumerate(zip(want.shape, got.shape, strict=True)) if a != b]
        for i in changed:
            if (want.shape[i], got.shape[i]) != (size, padded_size):
                return AxisSafety(
                    axis=axis,
                    safe=False,
                    reason=f"output {name!r} axis {i} goes {want.shape[i]} -> {got.shape[i]} "
                    f"when the input axis goes {size} -> {padded_size}: not cut back 1:1",
                )
        if changed:
            output_axes[name] = changed
        cut[name] = got[tuple(slice(0, n) for n in want.shape)]

    comparison = compare_outputs(cut, exact, rtol, atol)
    return AxisSafety(
        axis=axis,
        safe=comparison.matches,
        reason=f"outputs match after padding {size} -> {padded_size}"
        if comparison.matches
        else f"padding changes the outputs: {comparison.detail}",
        output_axes=output_axes,
        max_abs_error=comparison.max_abs_error,
    )
