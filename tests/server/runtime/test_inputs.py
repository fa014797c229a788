"""parse_inputs: JSON values -> arrays of the model's dtypes, or a 400 naming the problem."""

from __future__ import annotations

import numpy as np
import pytest

from compiler.errors import BadRequestError
from compiler.signature import Signature, TensorSpec
from server.runtime.inputs import parse_inputs

SIGNATURE = Signature(
    inputs=(
        TensorSpec("x", "float32", ("batch", 2)),
        TensorSpec("ids", "int64", ("batch",)),
        TensorSpec("mask", "bool", ("batch",)),
    ),
    outputs=(TensorSpec("y", "float32", ("batch",)),),
)
GOOD = {"x": [[1, 2.5], [3, 4]], "ids": [1, 2], "mask": [True, 0]}


def test_converts_to_model_dtypes():
    arrays = parse_inputs(SIGNATURE, GOOD)
    assert arrays["x"].dtype == np.float32 and arrays["x"].shape == (2, 2)
    assert arrays["ids"].dtype == np.int64 and arrays["ids"].tolist() == [1, 2]
    assert arrays["mask"].dtype == np.bool_ and arrays["mask"].tolist() == [True, False]
    # Integral floats are fine for an integer input.
    assert parse_inputs(SIGNATURE, GOOD | {"ids": [1.0, 2.0]})["ids"].dtype == np.int64


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ([1, 2], "'inputs' must be an object"),
        (GOOD | {"extra": [1]}, "unknown input 'extra'"),
        ({k: v for k, v in GOOD.items() if k != "ids"}, "missing input 'ids'"),
        (GOOD | {"x": [[1, 2], [3]]}, "'x' is ragged"),
        (GOOD | {"x": [["a", "b"], ["c", "d"]]}, "'x' must be numeric"),
        (GOOD | {"x": [1, 2]}, "'x' has rank 1, expected 2"),
        (GOOD | {"ids": [1.5, 2]}, "'ids' has dtype int64"),
        (GOOD | {"mask": [2, 0]}, "'mask' has dtype bool"),
        (GOOD | {"x": None}, "'x'"),
    ],
)
def test_rejects_bad_inputs_naming_the_problem(inputs, message):
    with pytest.raises(BadRequestError, match=message):
        parse_inputs(SIGNATURE, inputs)
