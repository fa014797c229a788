"""parse_inputs: JSON values -> arrays of the model's dtypes, or a 400 naming the problem."""

from __future__ import annotations

import numpy as np
import pytest

from compiler.errors import BadRequestError
from compiler.models.signature import Signature, TensorSpec
from server.runtime.serving.inputs import parse_inputs

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


def test_scalars_stay_rank_0_and_empty_batches_take_the_model_dims():
    signature = Signature(
        inputs=(TensorSpec("sr", "int64", ()), TensorSpec("x", "float32", ("batch", 3))),
        outputs=(TensorSpec("y", "float32", ("batch", 3)),),
    )
    arrays = parse_inputs(signature, {"sr": 16000, "x": []})
    assert arrays["sr"].shape == () and arrays["sr"].dtype == np.int64 and int(arrays["sr"]) == 16000
    assert arrays["x"].shape == (0, 3) and arrays["x"].dtype == np.float32
    with pytest.raises(BadRequestError, match="'sr' has rank 1, expected 0"):
        parse_inputs(signature, {"sr": [16000], "x": []})


def test_index_ranges_are_checked_after_conversion():
    ranges = {"ids": (-4, 3, "Gather 'table'")}
    assert parse_inputs(SIGNATURE, GOOD | {"ids": [-4, 3]}, ranges)["ids"].tolist() == [-4, 3]
    for bad in ([4, 0], [0, -5], [999999, 0]):
        with pytest.raises(BadRequestError, match=r"'ids' has values outside \[-4, 3\]: it indexes Gather 'table'"):
            parse_inputs(SIGNATURE, GOOD | {"ids": bad}, ranges)
