"""Request inputs -> arrays of the model's dtypes, with a 400 naming what is wrong."""

from __future__ import annotations

from typing import Any

import numpy as np

from compiler.errors import BadRequestError
from compiler.models.signature import Signature
from compiler.running.arrays import contiguous


def parse_inputs(
    signature: Signature, inputs: Any, index_ranges: dict[str, tuple[int, int, str]] | None = None
) -> dict[str, np.ndarray]:
    """JSON values -> arrays of the model's dtypes; 400 naming what is wrong."""
    if not isinstance(inputs, dict):
        raise BadRequestError("'inputs' must be an object mapping input names to nested lists")
    expected = signature.input_names
    for name in inputs:
        if name not in expected:
            raise BadRequestError(f"unknown input {name!r}; the model takes {expected}")
    arrays = {}
    for spec in signature.inputs:
        if spec.name not in inputs:
            raise BadRequestError(f"missing input {spec.name!r}")
        try:
            array = np.asarray(inputs[spec.name])
        except ValueError:
            raise BadRequestError(
                f"input {spec.name!r} is ragged: nested lists must form a rectangular array"
            ) from None
        if array.dtype == object:
            raise BadRequestError(f"input {spec.name!r} must be a rectangular nested list of numbers")
        if array.dtype.kind not in "biuf":
            raise BadRequestError(f"input {spec.name!r} must be numeric, got {array.dtype.kind!r} data")
        if array.size == 0 and array.ndim != spec.rank and any(isinstance(d, str) for d in spec.dims):
            # JSON cannot say the shape of an empty tensor: [] is a zero-size batch of the model's dims.
            array = array.reshape([0 if isinstance(d, str) else d for d in spec.dims])
        if array.ndim != spec.rank:
            raise BadRequestError(f"input {spec.name!r} has rank {array.ndim}, expected {spec.rank} {list(spec.dims)}")
        want = np.dtype(spec.dtype)
        if array.dtype == want:  # nothing a conversion could change (binary V2 tensors, mostly)
            arrays[spec.name] = contiguous(array)
            continue
        if want.kind in "iub" and array.dtype.kind == "f" and not np.all(np.mod(array, 1) == 0):
            raise BadRequestError(f"input {spec.name!r} has dtype {spec.dtype}: got non-integer values")
        if want.kind in "iu" and array.size:
            low, high = np.iinfo(want).min, np.iinfo(want).max
            if array.min() < low or array.max() >= high + 1:  # + 1: high rounds up as a float
                raise BadRequestError(f"input {spec.name!r} has dtype {spec.dtype}: values outside [{low}, {high}]")
        if want.kind == "b" and array.size and not np.all((array == 0) | (array == 1)):
            raise BadRequestError(f"input {spec.name!r} has dtype bool: values must be 0/1 or true/false")
        converted = array.astype(want)
        # One pass in the common case: only a non-finite result sends us back to the request's values.
        if want.kind == "f" and not np.isfinite(converted).all() and np.isfinite(array).all():
            raise BadRequestError(f"input {spec.name!r} has dtype {spec.dtype}: values overflow it")
        arrays[spec.name] = contiguous(converted)
    for name, (low, high, indexed) in (index_ranges or {}).items():
        values = arrays[name]
        if values.size and (values.min() < low or values.max() > high):
            raise BadRequestError(f"input {name!r} has values outside [{low}, {high}]: it indexes {indexed}")
    return arrays
