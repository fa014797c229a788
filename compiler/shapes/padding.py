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

from ..errors import UnavailableError
from ..models.memory import inputs_fit
from ..models.signature import Signature
from ..running.arrays import compare_outputs, random_inputs
from ..running.engines import Engine
from .buckets import AxisPolicy, AxisSafety, pad_inputs


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
    outputs = []
    for at, inputs in ((size, exact_inputs), (padded_size, padded_inputs)):
        try:
            outputs.append(engine.run(inputs))
        except Exception as exc:  # noqa: BLE001 - the model itself rejects the shape
            return AxisSafety(
                axis=axis,
                safe=False,
                reason=f"model fails at the probe shape: {type(exc).__name__}: {exc}",
                probe_failed=True,
                refused_size=at,
            )
    exact, padded = outputs

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


PROBE_VERSION = 2
"""Bumped when verdicts change meaning: a stored model probed under an older version is probed again
(version 1 probed every axis at 3 -> 4, where a convnet's feature maps collapse and hide the padding)."""

BATCH_PROBE_SIZE = 3
"""The leading axis (the batch, where a model has one) starts at 3 -> 4: no stride shrinks a batch, and a
batch-mixing op sees the padded row at any size."""
PROBE_SIZE = 224
"""Every other axis starts at 224 -> 256, a size images and texts really have: after a convnet's strides
of 16-32 its maps keep cells for the padding to reach. Smaller sizes hide it: PP-OCR det's height and
width pass at 3 -> 4, 64 -> 256 and 128 -> 256 with the other axis alike, and fail at 224 -> 256."""
COMMON_SIZES = (32, 48, 64, 96, 128, 224, 256, 320, 384, 512, 640, 1024, 16, 8, 1)
"""Sizes tried together on the axes the user did not size, when the model refuses the starting shape (a
detector exported for 320x320, a ViT for 224); smallest first, where a refusal costs least."""
FALLBACK_PROBE_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024, 4, 2, 1)
"""Sizes tried on one axis, the others at a shape the model runs, when the model refuses its padded size."""
MAX_PROBES_PER_AXIS = 6
CONFIRM_FACTOR = 3
"""Padding found harmless is checked again at 3x the size (32 -> 96, padded to 128): one size can hide
what another shows."""


def default_probe_sizes(signature: Signature, known: dict[str, int] | None = None) -> dict[str, int]:
    """Starting sizes for every symbolic axis: ``known`` ones (a config's or a warm bucket's), else
    ``BATCH_PROBE_SIZE`` for the leading axis and ``PROBE_SIZE`` for the rest."""
    lead = signature.leading_axis()
    sizes = {axis: BATCH_PROBE_SIZE if axis == lead else PROBE_SIZE for axis in signature.axes()}
    sizes.update({axis: size for axis, size in (known or {}).items() if axis in sizes})
    return sizes


def _shapes(signature: Signature, sizes: dict[str, int]) -> dict[str, tuple[int, ...]]:
    return {spec.name: tuple(d if isinstance(d, int) else sizes[d] for d in spec.dims) for spec in signature.inputs}


class _Probe:
    """The ONNX Runtime runs of one upload's probe, within its byte limit, deadline and cancellation."""

    def __init__(
        self,
        engine: Engine,
        signature: Signature,
        *,
        max_input_bytes: int | None,
        deadline: float | None,
        cancelled: threading.Event | None,
        check: dict,
    ) -> None:
        self.engine = engine
        self.signature = signature
        self.max_input_bytes = max_input_bytes
        self.deadline = deadline
        self.cancelled = cancelled
        self.check = check
        """check_axis_padding's keyword arguments shared by every axis."""
        self.tried: dict[str, list[int]] = {}
        """Axis -> the sizes the model refused on it (with the other axes at a shape it runs at)."""
        self.base_tried: dict[str, list[int]] = {}
        """Axis -> its sizes in the shapes the model refused while a base shape was looked for."""

    def fits(self, sizes: dict[str, int]) -> bool:
        return self.max_input_bytes is None or inputs_fit(self.signature, sizes, self.max_input_bytes)

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def stop_if_cancelled(self) -> None:
        if self.cancelled is not None and self.cancelled.is_set():
            raise UnavailableError("padding probe cancelled: the server is shutting down, or its model was retired")

    def runs_at(self, sizes: dict[str, int]) -> str | None:
        """None when the model runs at these axis sizes, else its error (the sizes count as tried)."""
        self.stop_if_cancelled()
        shapes = _shapes(self.signature, sizes)
        dtypes = {spec.name: spec.dtype for spec in self.signature.inputs}
        try:
            self.engine.run(random_inputs(shapes, dtypes, self.check["seed"], self.check["index_limits"]))
        except Exception as exc:  # noqa: BLE001 - the model itself refuses the shape
            for axis, size in sizes.items():
                self.base_tried.setdefault(axis, []).append(size)
            return f"{type(exc).__name__}: {exc}"
        return None

    def find_base(self, start: dict[str, int], variable: set[str]) -> tuple[dict[str, int] | None, str | None]:
        """A shape the model runs at, and the last error (the base is None when none was found; the error
        too when no shape tried fits the byte limit).

        ``start`` when the model runs it; else the ``variable`` axes together at each of the
        ``COMMON_SIZES`` (the leading axis at its start size, then at 1), and then each of those axes back
        at its start size where the model takes that alone (PP-OCR rec runs at height 48 or 32, and any
        width: its width goes back to 224)."""
        lead = self.signature.leading_axis()
        spread = [axis for axis in self.signature.axes() if axis in variable and axis != lead]
        lead_sizes = [start[lead], 1] if lead in variable and start[lead] != 1 else [start[lead]] if lead else [0]
        candidates: list[dict[str, int]] = []
        for lead_size in lead_sizes:
            for common in (None, *COMMON_SIZES):
                sizes = dict(start, **({lead: lead_size} if lead else {}))
                if common is not None:
                    sizes.update(dict.fromkeys(spread, common))
                if sizes not in candidates and self.fits(sizes):
                    candidates.append(sizes)
        error = None
        for base in candidates:
            if self.out_of_time():
                return None, f"{error}; then the probe ran out of time"
            failure = self.runs_at(base)
            if failure is None:
                break
            error = failure
        else:
            return None, error
        for axis in spread:
            raised = dict(base, **{axis: start[axis]})
            if raised != base and self.fits(raised) and not self.out_of_time() and self.runs_at(raised) is None:
                base = raised
        return base, ""

    def axis(self, axis: str, base: dict[str, int], policy: AxisPolicy, variable: bool) -> AxisSafety | None:
        """The padding verdict of ``axis``, the other axes at ``base``: at its base size, else (the model
        refusing the padded size) at other sizes; one found harmless is confirmed at a larger size. None
        when every size is over the byte limit."""
        sizes = [base[axis]] + ([s for s in FALLBACK_PROBE_SIZES if s != base[axis]] if variable else [])
        probes = [(size, _padded_size(policy, size)) for size in sizes]
        probes = [(size, padded) for size, padded in probes if self.fits(dict(base, **{axis: padded}))]
        result = None
        for size, padded in probes[:MAX_PROBES_PER_AXIS]:
            result = self._check(axis, dict(base, **{axis: size}), padded, policy)
            if not result.probe_failed:
                break
            self.tried.setdefault(axis, []).append(result.refused_size)
        else:
            return result
        if not result.safe or result.approximate:
            return result
        size = CONFIRM_FACTOR * (size if size > 1 else 2)
        padded = _padded_size(policy, size)
        if (policy.largest is not None and size > policy.largest) or not self.fits(dict(base, **{axis: padded})):
            return result
        confirmed = self._check(axis, dict(base, **{axis: size}), padded, policy)
        return result if confirmed.probe_failed or confirmed.safe else confirmed

    def _check(self, axis: str, sizes: dict[str, int], padded: int, policy: AxisPolicy) -> AxisSafety:
        self.stop_if_cancelled()
        return check_axis_padding(
            self.engine, self.signature, axis, sizes, padded, tolerance=policy.approximate, **self.check
        )


def policy_verdict(axis: str, policy: AxisPolicy) -> AxisSafety | None:
    """The verdict an axis's policy gives alone (``exact`` and ``dynamic`` axes are never padded); None for
    an axis only the probe can judge."""
    if policy.kind == "exact":
        return AxisSafety(axis=axis, safe=False, reason="policy is exact: never padded")
    if policy.kind == "dynamic":
        served = f"{policy.min}..{policy.max}" + (f" in steps of {policy.step}" if policy.step > 1 else "")
        return AxisSafety(
            axis=axis, safe=False, reason=f"policy is dynamic: never padded; one symbolic kernel serves {served}"
        )
    return None


def policy_verdicts(signature: Signature, policies: dict[str, AxisPolicy]) -> dict[str, AxisSafety]:
    """The verdicts of the axes whose policy decides alone: known at once, without running the model."""
    verdicts = {axis: policy_verdict(axis, policies[axis]) for axis in signature.axes()}
    return {axis: verdict for axis, verdict in verdicts.items() if verdict is not None}


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
    """The padding-safety check of every symbolic axis, one axis at a time, the others at a shape the
    model runs at.

    That shape starts at ``sizes`` (see :func:`default_probe_sizes`); when the model refuses it, the axes
    not in ``configured`` (sizes the user chose) are tried together at common sizes. Each axis is then
    padded from its size there to its next bucket; when the model refuses that (a model that runs at one
    size only), other sizes of that axis alone follow, and an axis no size worked for is served exactly,
    with the sizes tried, the model's error and the config field that fixes it.

    The probe is bounded: sizes whose inputs would exceed ``max_input_bytes`` are skipped, axes left when
    ``seconds`` run out are served exactly, and ``cancelled`` (shutdown, or its model deleted or replaced)
    ends it with :class:`UnavailableError`.
    """
    results = policy_verdicts(signature, policies)
    probed = [axis for axis in signature.axes() if axis not in results]
    if not probed:
        return results
    probe = _Probe(
        engine,
        signature,
        max_input_bytes=max_input_bytes,
        deadline=None if seconds is None else time.monotonic() + seconds,
        cancelled=cancelled,
        check={"pad_values": pad_values, "rtol": rtol, "atol": atol, "seed": seed, "index_limits": index_limits},
    )
    variable = set(signature.axes()) - set(configured)
    base, error = probe.find_base(dict(sizes), variable)
    for axis in probed:
        if base is None:
            result = error and AxisSafety(axis=axis, safe=False, reason=error, probe_failed=True)
        elif probe.out_of_time():
            reason = f"not probed: the padding probe ran out of its {seconds:g} s; served exactly"
            result = AxisSafety(axis=axis, safe=False, reason=reason, probed=False)
        else:
            result = probe.axis(axis, base, policies[axis], axis in variable)
        if result is None:  # every size was over the input limit
            reason = f"not probed: its probe sizes make inputs over {max_input_bytes} bytes; served exactly"
            result = AxisSafety(axis=axis, safe=False, reason=reason, probed=False)
        elif result.probe_failed:
            runs = "" if base is None else f"; it runs at {base[axis]}"
            refused = sorted(set((probe.tried if base else probe.base_tried).get(axis, [])))
            result = result.model_copy(
                update={
                    "reason": f"could not probe axis {axis!r}: the model fails at sizes {refused}{runs} "
                    f"({result.reason.removeprefix('model fails at the probe shape: ')}); served exactly. "
                    f'Set config probe_sizes {{"{axis}": N}} to a size the model accepts to check padding.'
                }
            )
        results[axis] = result
    return results
