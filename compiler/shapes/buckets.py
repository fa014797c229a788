"""Shape buckets: per-axis policies, the request -> bucket mapping, padding.

A request shape maps to one bucket shape. Only axes whose padding-safety
check passed are padded (see :mod:`compiler.shapes.padding`). A ``dynamic`` axis is
never padded: within its range the bucket keeps the dim symbolic, one kernel
for every size, and the dim's name carries the range (``W@257..1024``). An
axis whose padding would change the outputs gets the dynamic tier by default,
in ranges of 4x (``DEFAULT_SPAN``); one declared ``exact`` (or one the probe
could not run on) is served exactly, one bucket per size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
from pydantic import BaseModel, Field, model_validator

from ..errors import BadRequestError, ShapeOutOfRangeError
from ..models.signature import Signature

if TYPE_CHECKING:
    from ..running.engines import Engine

Bucket = dict[str, tuple[int | str, ...]]
"""Input name -> bucket shape; a dim given as a name stays symbolic (a ``dynamic`` axis)."""

DEFAULT_SPAN = 4
"""An axis padding would change gets dynamic ranges (4^k, 4^(k+1)]: widths 48..800 are three kernels."""


def symbolic_dim(axis: str, low: int, high: int, step: int = 1) -> str:
    """The bucket dim that keeps ``axis`` symbolic for sizes ``low..high`` (multiples of ``step``)."""
    return f"{axis}@{low}..{high}" + (f":{step}" if step > 1 else "")


def dim_axis(dim: str) -> str:
    """The axis a bucket's symbolic dim belongs to."""
    return dim.split("@", 1)[0]


def dim_range(dim: str) -> tuple[int, int] | None:
    """The sizes a bucket's symbolic dim serves (``None`` for a bare name, which carries none)."""
    _, sep, sizes = dim.partition("@")
    low, dots, high = sizes.partition(":")[0].partition("..")
    if not sep or not dots or not low.isdigit() or not high.isdigit():
        return None
    return int(low), int(high)


def dim_step(dim: str) -> int:
    """What every size a bucket's symbolic dim serves is a multiple of (1 unless it says ``:step``)."""
    step = dim.partition("@")[2].partition(":")[2]
    return int(step) if step.isdigit() and int(step) > 0 else 1


class AxisPolicy(BaseModel):
    """How one symbolic axis maps request sizes to bucket sizes."""

    kind: Literal["pow2", "list", "exact", "dynamic"] = "pow2"
    min: int = Field(1, ge=1, description="pow2: smallest bucket size; dynamic: smallest size of the symbolic kernel")
    max: int = Field(64, ge=1, description="pow2: largest bucket size; dynamic: largest size of the symbolic kernel")
    sizes: list[int] = Field(default_factory=list, description="list: the bucket sizes")
    span: int | None = Field(
        None,
        ge=2,
        description="dynamic: one kernel per range (span^k, span^(k+1)] within min..max, each compiled when traffic "
        "first reaches it; none: one kernel for all of min..max",
    )
    step: int = Field(
        1,
        ge=1,
        description="dynamic: the kernel serves multiples of this only (others are served exactly). A model "
        "that halves an axis k times and adds levels back together (a detector's FPN) needs multiples of 2^k "
        "to keep its shapes consistent: 32 for DBNet and YOLO; its kernel is compiled for step x a symbolic count",
    )
    approximate: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="opt-in, for models whose own preprocessing pads (text lines, letterboxed images): "
        "pad even though padding changes the outputs, by at most this absolute error (checked at upload, "
        "measured per bucket)",
    )

    @model_validator(mode="after")
    def _check(self) -> AxisPolicy:
        if self.approximate is not None and self.kind in ("exact", "dynamic"):
            raise ValueError(f"an {self.kind!r} policy never pads: 'approximate' needs 'pow2' or 'list'")
        if self.kind == "list":
            if not self.sizes or any(s < 1 for s in self.sizes):
                raise ValueError("a 'list' policy needs positive sizes")
            self.sizes = sorted(set(self.sizes))
        if self.kind in ("pow2", "dynamic") and self.min > self.max:
            raise ValueError(f"{self.kind} policy has min > max")
        if self.step > 1 and (self.kind != "dynamic" or self.max < self.step):
            raise ValueError("'step' needs a 'dynamic' policy whose max is at least the step")
        return self

    def symbolic(self, size: int) -> bool:
        """A ``dynamic`` axis's size within its range: served by a symbolic kernel, not a bucket of its own
        (sizes outside it are served exactly: a kernel serves only the range it was verified over)."""
        return self.kind == "dynamic" and self.min <= size <= self.max and size % self.step == 0

    def dynamic_range(self, size: int) -> tuple[int, int]:
        """The range of the symbolic kernel that serves ``size`` (within min..max, ends on the step)."""
        low, high = self.min, self.max
        if self.span is not None:
            high = 1
            while high < size:
                high *= self.span
            low = max(high // self.span + 1 if high > 1 else 1, self.min)
            high = min(high, self.max)
        return -(-low // self.step) * self.step, high // self.step * self.step

    @property
    def largest(self) -> int | None:
        """The largest bucket size; None for ``exact`` and ``dynamic`` (unbounded)."""
        return {"pow2": self.max, "list": self.sizes[-1] if self.sizes else None}.get(self.kind)

    def bucket_size(self, size: int) -> int | None:
        """The bucket for a request size, or None when beyond the largest bucket."""
        if self.kind in ("exact", "dynamic"):
            return size
        if self.kind == "list":
            return next((s for s in self.sizes if s >= size), None)
        if size > self.max:
            return None
        # The last bucket is max itself, power of two or not.
        return min(self.max, max(self.min, 1 << (size - 1).bit_length()))


class AxisSafety(BaseModel):
    """Result of the padding-safety check for one symbolic axis."""

    axis: str
    safe: bool
    reason: str
    # output name -> indices of that output's axes that follow this axis 1:1
    output_axes: dict[str, list[int]] = Field(default_factory=dict)
    max_abs_error: float | None = None
    probe_failed: bool = False
    """The model itself refused the probe shape: nothing was learned about padding."""
    refused_size: int | None = None
    """The axis's size the model refused (with ``probe_failed``)."""
    approximate: bool = False
    """Padding changes the outputs, within the policy's ``approximate`` tolerance."""
    probed: bool = True
    """False when no probe ran (out of time, or inputs over the limit): unsafe for want of knowing."""


TAIL_PERIOD = 64
"""A multiple of every vector tile a dynamic kernel splits an axis into (8 and 16 lanes, two vectors)."""


def tail_sizes(low: int, high: int, period: int = TAIL_PERIOD) -> list[int]:
    """Sizes within ``low..high`` that leave each kind of tail on a symbolic axis's vector tiles: whole
    tiles (a multiple of 64), one element over, one under, and 7 under (a tile-1 tail on an axis that
    stride-4 layers shrank: (W - 1) // 4 + 1 = 15 mod 16), around the largest multiple of 64 up to ``high``."""
    multiple = high // period * period
    if multiple == 0:
        return []
    return [size for size in (multiple - 7, multiple - 1, multiple, multiple + 1) if low <= size <= high]


def bucket_label(bucket: Bucket) -> str:
    """Canonical text for a bucket, e.g. ``x=8x3x48x192``."""
    return ",".join(f"{name}={'x'.join(map(str, shape)) or 'scalar'}" for name, shape in sorted(bucket.items()))


def is_symbolic(bucket: Bucket) -> bool:
    """A bucket of the dynamic-shape tier: some dim is an axis's name."""
    return any(isinstance(d, str) for shape in bucket.values() for d in shape)


@dataclass(frozen=True)
class BucketPlan:
    request: Bucket
    bucket: Bucket
    request_axes: dict[str, int]
    bucket_axes: dict[str, int | str]
    """Axis -> bucket size, or the axis's own name where the bucket keeps it symbolic."""

    @property
    def padded_axes(self) -> dict[str, int]:
        """Axis -> request size, for every axis the bucket pads."""
        return {
            a: n
            for a, n in self.request_axes.items()
            if self.bucket_axes[a] != n and isinstance(self.bucket_axes[a], int)
        }

    @property
    def run_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shapes the bucket's kernel runs at: the bucket, with the request's sizes for its symbolic dims."""
        return {
            name: tuple(self.request_axes[dim_axis(d)] if isinstance(d, str) else d for d in shape)
            for name, shape in self.bucket.items()
        }

    def padding_waste(self) -> float:
        """Padded elements / bucket elements, over all inputs."""
        bucket_elems = sum(int(np.prod(s)) for s in self.run_shapes.values())
        request_elems = sum(int(np.prod(s)) for s in self.request.values())
        return 0.0 if bucket_elems == 0 else (bucket_elems - request_elems) / bucket_elems


class BucketPlanner:
    """Maps request shapes to buckets for one model."""

    def __init__(
        self,
        signature: Signature,
        policies: dict[str, AxisPolicy] | None = None,
        safety: dict[str, AxisSafety] | None = None,
        overflow: Literal["error", "exact"] = "error",
        pinned: dict[str, set[int]] | None = None,
    ) -> None:
        self.signature = signature
        self.policies = policies or {}
        self.safety = safety or {}
        self.overflow = overflow
        self.pinned = pinned or {}
        """Axis -> sizes served by static buckets of their own even where the default dynamic ranges
        cover them (the warm buckets' sizes: shapes the user asked to be fast, and a static kernel is)."""

    def effective_policy(self, axis: str) -> AxisPolicy:
        """An axis pads only with a policy *and* a passed safety check; a dynamic one never pads. A padding
        policy whose check found that padding changes the outputs becomes dynamic (ranges of
        ``DEFAULT_SPAN`` up to its largest bucket): a kernel per range instead of one per size."""
        policy = self.policies.get(axis)
        if policy is not None and policy.kind == "dynamic":
            return policy
        check = self.safety.get(axis)
        if policy is None or policy.kind == "exact" or check is None:
            return AxisPolicy(kind="exact")
        if check.safe:
            return policy
        if check.probe_failed or not check.probed or policy.largest is None:
            return AxisPolicy(kind="exact")
        return AxisPolicy(kind="dynamic", min=1, max=policy.largest, span=DEFAULT_SPAN)

    def plan(self, shapes: dict[str, tuple[int, ...]]) -> BucketPlan:
        axis_sizes: dict[str, int] = {}
        for spec in self.signature.inputs:
            if spec.name not in shapes:
                raise BadRequestError(f"missing input {spec.name!r}")
            shape = tuple(shapes[spec.name])
            if len(shape) != spec.rank:
                raise BadRequestError(
                    f"input {spec.name!r} has rank {len(shape)}, expected {spec.rank} {list(spec.dims)}"
                )
            for index, (dim, size) in enumerate(zip(spec.dims, shape, strict=True)):
                if isinstance(dim, int):
                    if size != dim:
                        raise BadRequestError(
                            f"input {spec.name!r} axis {index} is {size}, the model fixes it at {dim}"
                        )
                    continue
                if size < 1:
                    raise BadRequestError(f"input {spec.name!r} axis {index} ({dim}) must be >= 1")
                if axis_sizes.setdefault(dim, size) != size:
                    raise BadRequestError(f"axis {dim!r} is {axis_sizes[dim]} in one input and {size} in {spec.name!r}")
        unknown = set(shapes) - set(self.signature.input_names)
        if unknown:
            raise BadRequestError(f"unknown input {sorted(unknown)[0]!r}; the model takes {self.signature.input_names}")

        bucket_axes: dict[str, int | str] = {}
        for axis, size in axis_sizes.items():
            policy = self.effective_policy(axis)
            if policy.symbolic(size) and not (policy.span and size in self.pinned.get(axis, ())):
                bucket_axes[axis] = symbolic_dim(axis, *policy.dynamic_range(size), policy.step)
                continue
            bucket = policy.bucket_size(size)
            if bucket is None:
                if self.overflow == "error":
                    raise ShapeOutOfRangeError(
                        f"axis {axis!r} size {size} is beyond the largest bucket ({self.policies[axis].largest})"
                    )
                bucket = size
            bucket_axes[axis] = bucket

        request = {s.name: tuple(shapes[s.name]) for s in self.signature.inputs}
        bucket = {
            s.name: tuple(d if isinstance(d, int) else bucket_axes[d] for d in s.dims) for s in self.signature.inputs
        }
        return BucketPlan(request, bucket, axis_sizes, bucket_axes)

    def typical_request(self, bucket: Bucket) -> Bucket:
        """A request shape this bucket serves, halfway between the smallest and the bucket itself
        on every padded axis: what routing times the engines at, as serving runs them."""
        return self._request_within(bucket, lambda lowest, size: (lowest + size + 1) // 2)

    def most_padded_request(self, bucket: Bucket) -> Bucket:
        """The smallest request shape this bucket serves: the most padding it ever adds."""
        return self._request_within(bucket, lambda lowest, _: lowest)

    def approximate_tolerance(self, bucket: Bucket) -> float | None:
        """The smallest ``approximate`` tolerance among the axes this bucket pads approximately; None if none."""
        tolerances = [
            self.policies[axis].approximate
            for spec in self.signature.inputs
            for _, axis in spec.symbolic_axes()
            if axis in self.safety and self.safety[axis].approximate and self.effective_policy(axis).approximate
        ]
        return min(tolerances) if tolerances else None

    def verify_sizes(self, bucket: Bucket) -> dict[str, list[int]]:
        """For each symbolic dim of the bucket, the sizes its kernel is verified at: the ends and middle of
        its range, and the tails of its vector tiles (:func:`tail_sizes`)."""
        sizes = {}
        for dim in {d for shape in bucket.values() for d in shape if isinstance(d, str)}:
            low, high = self._range_of(dim)
            step = dim_step(dim)
            if step == 1:
                sizes[dim] = sorted({low, (low + high + 1) // 2, high, *tail_sizes(low, high)})
                continue
            # The layer that divided the size by ``step`` holds the count, and vectorizes it in 16s.
            counts = range(low // step, high // step + 1)
            middle = counts[len(counts) // 2]
            tails = tail_sizes(counts[0], counts[-1], period=16)
            sizes[dim] = sorted({count * step for count in (counts[0], middle, counts[-1], *tails)})
        return sizes

    def _range_of(self, dim: str) -> tuple[int, int]:
        """A symbolic dim's range: its own, else its axis policy's (a bucket given by a bare name)."""
        found = dim_range(dim)
        if found is not None:
            return found
        policy = self.effective_policy(dim_axis(dim))
        return policy.min, policy.max

    def _request_within(self, bucket: Bucket, pick) -> Bucket:
        sizes: dict[str, int] = {}
        for spec in self.signature.inputs:
            for index, axis in spec.symbolic_axes():
                size = bucket[spec.name][index]
                policy = self.effective_policy(axis)
                if isinstance(size, str):  # symbolic: no padding, a size from its range (on its step)
                    low, high = self._range_of(size)
                    step = dim_step(size)
                    sizes[axis] = max(low, pick(low, high) // step * step)
                    continue
                lowest = size
                while lowest > 1 and size - lowest < 4096 and policy.bucket_size(lowest - 1) == size:
                    lowest -= 1
                sizes[axis] = pick(lowest, size)
        return {
            spec.name: tuple(d if isinstance(d, int) else sizes[d] for d in spec.dims) for spec in self.signature.inputs
        }

    def run_padded(
        self,
        engine: Engine,
        inputs: dict[str, np.ndarray],
        plan: BucketPlan,
        pad_values: dict[str, float] | None = None,
    ) -> dict[str, np.ndarray]:
        """What a kernel serving the bucket does with a request: pad it to the bucket, run, cut back."""
        return self.unpad(engine.run(self.pad(inputs, plan, pad_values)), plan)

    def pad(
        self, inputs: dict[str, np.ndarray], plan: BucketPlan, pad_values: dict[str, float] | None = None
    ) -> dict[str, np.ndarray]:
        return pad_inputs(inputs, plan.run_shapes, pad_values)

    def unpad(self, outputs: dict[str, np.ndarray], plan: BucketPlan) -> dict[str, np.ndarray]:
        cut = dict(outputs)
        for axis, size in plan.padded_axes.items():
            for name, indices in self.safety[axis].output_axes.items():
                array = cut[name]
                index = [slice(None)] * array.ndim
                for i in indices:
                    index[i] = slice(0, size)
                cut[name] = array[tuple(index)]
        return cut


def pad_inputs(
    inputs: dict[str, np.ndarray], bucket: dict[str, tuple[int, ...]], pad_values: dict[str, float] | None = None
) -> dict[str, np.ndarray]:
    """Pad each input at the end of every axis up to the bucket shape (sizes only: see ``run_shapes``)."""
    padded = {}
    for name, array in inputs.items():
        target = bucket[name]
        widths = [(0, t - s) for s, t in zip(array.shape, target, strict=True)]
        if any(w for _, w in widths):
            value = (pad_values or {}).get(name, 0)
            padded[name] = np.pad(array, widths, mode="constant", constant_values=value)
        else:
            padded[name] = array
    return padded
