"""Padding-safety check: may this symbolic axis be padded up to a bucket?

ONNX Runtime runs a seeded random input at an exact size and the same input
padded along the axis. Every output axis that changes size must follow the
input axis 1:1 (so it can be cut back), and the cut-back outputs must match.
The batch axis of most models passes; spatial axes of CNNs (pooling sees the
padding) and unmasked sequence axes (attention sees it) fail.
"""

from __future__ import annotations

import threading
import time

from .arrays import compare_outputs, random_inputs
from .buckets import AxisPolicy, AxisSafety, pad_inputs
from .engines import Engine
from .errors import UnavailableError
from .memory import inputs_fit
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
    index_limits: dict[str, int] | None = None,
    tolerance: float | None = None,
) -> AxisSafety:
    """Check ``axis`` at ``sizes[axis]`` padded to ``padded_size``.

    ``sizes`` gives a concrete size for every symbolic axis of the model. With a
    ``tolerance`` (the ``approximate`` policy) padding that changes the outputs
    by at most that absolute error passes too.
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
    exact_inputs = random_inputs(shapes_with(size), dtypes, seed, index_limits)
    padded_inputs = pad_inputs(exact_inputs, shapes_with(padded_size), pad_values)
    try:
        exact = engine.run(exact_inputs)
        padded = engine.run(padded_inputs)
    except Exception as exc:  # noqa: BLE001 - the model itself rejects the shape
        return AxisSafety(
            axis=axis,
            safe=False,
            reason=f"model fails at the probe shape: {type(exc).__name__}: {exc}",
            probe_failed=True,
        )

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
    error = comparison.max_abs_error
    if not comparison.matches and tolerance is not None and error <= tolerance:
        return AxisSafety(
            axis=axis,
            safe=True,
            approximate=True,
            reason=f"approximate: padding {size} -> {padded_size} changes the outputs by up to {error:.3g} "
            f"(tolerance {tolerance:g})",
            output_axes=output_axes,
            max_abs_error=error,
        )
    if not comparison.matches and tolerance is not None:
        return AxisSafety(
            axis=axis,
            safe=False,
            reason=f"padding changes the outputs by up to {error:.3g}, beyond the tolerance {tolerance:g}",
            output_axes=output_axes,
            max_abs_error=error,
        )
    return AxisSafety(
        axis=axis,
        safe=comparison.matches,
        reason=f"outputs match after padding {size} -> {padded_size}"
        if comparison.matches
        else f"padding changes the outputs: {comparison.detail}",
        output_axes=output_axes,
        max_abs_error=comparison.max_abs_error,
    )


def _padded_size(policy: AxisPolicy, size: int) -> int:
    """The bucket a probe size pads to; the next size up where it is its own bucket."""
    padded = policy.bucket_size(size)
    if padded is None or padded <= size:
        padded = policy.bucket_size(size + 1) or size + 1
    return padded


# Sizes tried, after the configured or warm one, when the model refuses a probe shape
# (a reflect Pad needs a long enough axis, a strided conv a multiple of its stride).
FALLBACK_PROBE_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024, 4, 2, 1)
MAX_PROBES_PER_AXIS = 6


def probe_padding(
    engine: Engine,
    signature: Signature,
    policies: dict[str, AxisPolicy],
    sizes: dict[str, int],
    *,
    configured: set[str] = frozenset(),
    pad_values: dict[str, float] | None = None,
    rtol: float = 1e-3,
    atol: float = 1e-4,
    seed: int = 0,
    index_limits: dict[str, int] | None = None,
    max_input_bytes: int | None = None,
    seconds: float | None = None,
    cancelled: threading.Event | None = None,
) -> dict[str, AxisSafety]:
    """The padding-safety check of every symbolic axis, each at a size the model accepts.

    ``sizes[axis]`` is tried first; for an axis not in ``configured`` (sizes the
    user chose), a few other sizes follow when the model refuses it. A size
    that worked is kept for the axes probed after it, and axes refused in a
    first pass are tried again with those sizes (the refusal may have been
    another axis's). An axis no size worked for says so, and names the config
    field that fixes it.

    The probe is bounded: sizes whose inputs would exceed ``max_input_bytes``
    are skipped, axes left when ``seconds`` run out are served exactly, and
    ``cancelled`` (shutdown) ends it with a 503.
    """
    sizes = dict(sizes)
    results: dict[str, AxisSafety] = {}
    tried: dict[str, list[int]] = {}
    deadline = None if seconds is None else time.monotonic() + seconds
    for _ in range(2):
        for axis in signature.axes():
            if axis in results and not results[axis].probe_failed:
                continue
            if deadline is not None and time.monotonic() > deadline:
                reason = f"not probed: the padding probe ran out of its {seconds:g} s; served exactly"
                results.setdefault(axis, AxisSafety(axis=axis, safe=False, reason=reason, probed=False))
                continue
            policy = policies[axis]
            if policy.kind == "exact":
                results[axis] = AxisSafety(axis=axis, safe=False, reason="policy is exact: never padded")
                continue
            if policy.kind == "dynamic":
                served = f"{policy.min}..{policy.max}" + (f" in steps of {policy.step}" if policy.step > 1 else "")
                reason = f"policy is dynamic: never padded; one symbolic kernel serves {served}"
                results[axis] = AxisSafety(axis=axis, safe=False, reason=reason)
                continue
            candidates = [sizes[axis]]
            if axis not in configured:
                candidates += [s for s in FALLBACK_PROBE_SIZES if s != sizes[axis]]
            probes = [(size, _padded_size(policy, size)) for size in candidates]
            if max_input_bytes is not None:
                probes = [p for p in probes if inputs_fit(signature, dict(sizes, **{axis: p[1]}), max_input_bytes)]
            for size, padded in probes[:MAX_PROBES_PER_AXIS]:
                if cancelled is not None and cancelled.is_set():
                    raise UnavailableError("the server is shutting down: upload not finished")
                result = check_axis_padding(
                    engine, signature, axis, dict(sizes, **{axis: size}), padded,
                    pad_values=pad_values, rtol=rtol, atol=atol, seed=seed, index_limits=index_limits,
                    tolerance=policy.approximate,
                )  # fmt: skip
                tried.setdefault(axis, []).append(size)
                results[axis] = result
                if not result.probe_failed:
                    sizes[axis] = size
                    break
    for axis in signature.axes():
        if axis not in results:  # every candidate size was over the input limit
            reason = f"not probed: its probe sizes make inputs over {max_input_bytes} bytes; served exactly"
            results[axis] = AxisSafety(axis=axis, safe=False, reason=reason, probed=False)
    for axis, result in results.items():
        if result.probe_failed:
            refused = sorted(set(tried[axis]))
            results[axis] = result.model_copy(
                update={
                    "reason": f"could not probe axis {axis!r}: the model fails at sizes {refused} "
                    f"({result.reason.removeprefix('model fails at the probe shape: ')}); served exactly. "
                    f'Set config probe_sizes {{"{axis}": N}} to a size the model accepts to check padding.'
                }
            )
    return results
