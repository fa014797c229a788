"""compiler.shapes.buckets: axis policies, request -> bucket plans, pad and unpad."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from pydantic import ValidationError

from compiler.errors import BadRequestError, ShapeOutOfRangeError
from compiler.models.signature import Signature, read_signature
from compiler.running.engines import OrtEngine
from compiler.shapes.buckets import (
    AxisPolicy,
    AxisSafety,
    BucketPlan,
    BucketPlanner,
    bucket_label,
    dim_axis,
    dim_range,
    dim_step,
    pad_inputs,
    tail_sizes,
)
from tests import synthetic

SAFE_BATCH = AxisSafety(axis="batch", safe=True, reason="test", output_axes={"y": [0]})
UNSAFE_BATCH = AxisSafety(axis="batch", safe=False, reason="test")


@pytest.fixture(scope="module")
def two_input_signature() -> Signature:
    return read_signature(onnx.load_from_string(synthetic.two_input_model()))


def _planner(signature, policy=None, safety=SAFE_BATCH, **kwargs) -> BucketPlanner:
    policy = policy or AxisPolicy(kind="pow2", min=1, max=16)
    return BucketPlanner(signature, {"batch": policy}, {"batch": safety} if safety else None, **kwargs)


# --- AxisPolicy -------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "bucket"), [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, 16), (33, 64), (64, 64), (65, None)]
)
def test_pow2_defaults(size, bucket):
    assert AxisPolicy().bucket_size(size) == bucket


@pytest.mark.parametrize(("size", "bucket"), [(1, 4), (4, 4), (5, 8), (16, 16), (17, None), (1000, None)])
def test_pow2_min_and_max(size, bucket):
    assert AxisPolicy(kind="pow2", min=4, max=16).bucket_size(size) == bucket


@pytest.mark.parametrize(("size", "bucket"), [(1, 3), (3, 3), (4, 10), (10, 10), (11, 100), (100, 100), (101, None)])
def test_list_policy(size, bucket):
    assert AxisPolicy(kind="list", sizes=[100, 3, 10]).bucket_size(size) == bucket


def test_list_policy_sorts_and_dedupes():
    assert AxisPolicy(kind="list", sizes=[8, 2, 8, 4]).sizes == [2, 4, 8]


@pytest.mark.parametrize("size", [1, 3, 17, 4096])
def test_exact_policy(size):
    assert AxisPolicy(kind="exact").bucket_size(size) == size


@pytest.mark.parametrize(
    "fields",
    [
        {"kind": "list"},
        {"kind": "list", "sizes": []},
        {"kind": "list", "sizes": [4, 0]},
        {"kind": "list", "sizes": [-2]},
        {"kind": "pow2", "min": 8, "max": 4},
        {"kind": "pow2", "min": 0},
        {"kind": "pow2", "max": 0},
        {"kind": "bucketed"},
        {"kind": "pow2", "min": "many"},
        {"kind": "pow2", "step": 32},
        {"kind": "dynamic", "min": 1, "max": 16, "step": 32},
        {"kind": "dynamic", "step": 0},
    ],
)
def test_bad_policies_are_rejected(fields):
    with pytest.raises(ValidationError):
        AxisPolicy(**fields)


def test_policy_from_json():
    policy = AxisPolicy.model_validate_json('{"kind": "list", "sizes": [16, 4]}')
    assert policy.sizes == [4, 16]


# --- BucketPlanner.plan -----------------------------------------------------


def test_exact_without_a_safety_result(two_input_signature):
    plan = _planner(two_input_signature, safety=None).plan({"a": (3, 8), "b": (3, 8)})
    assert plan.bucket == {"a": (3, 8), "b": (3, 8)}
    assert plan.padded_axes == {}
    assert plan.padding_waste() == 0.0


def test_dynamic_ranges_when_padding_would_change_the_outputs(two_input_signature):
    """No padding; a symbolic kernel per 4x range of sizes instead of a bucket per size."""
    planner = _planner(two_input_signature, safety=UNSAFE_BATCH)
    policy = planner.effective_policy("batch")
    assert (policy.kind, policy.min, policy.max, policy.span) == ("dynamic", 1, 16, 4)  # up to pow2's max
    plan = planner.plan({"a": (3, 8), "b": (3, 8)})
    assert plan.bucket == {"a": ("batch@2..4", 8), "b": ("batch@2..4", 8)}
    assert plan.run_shapes == {"a": (3, 8), "b": (3, 8)}
    assert plan.padded_axes == {}
    assert planner.plan({"a": (4, 8), "b": (4, 8)}).bucket == plan.bucket
    assert planner.plan({"a": (5, 8), "b": (5, 8)}).bucket == {"a": ("batch@5..16", 8), "b": ("batch@5..16", 8)}
    assert planner.plan({"a": (1, 8), "b": (1, 8)}).bucket == {"a": ("batch@1..1", 8), "b": ("batch@1..1", 8)}
    assert planner.plan({"a": (17, 8), "b": (17, 8)}).bucket == {"a": (17, 8), "b": (17, 8)}  # beyond: exact
    assert planner.verify_sizes(plan.bucket) == {"batch@2..4": [2, 3, 4]}


def test_a_pinned_size_keeps_a_static_bucket_within_the_default_dynamic_ranges(two_input_signature):
    """A warm bucket's size is a shape the user asked to be fast: it gets its own static kernel."""
    planner = BucketPlanner(
        two_input_signature, {"batch": AxisPolicy(max=16)}, {"batch": UNSAFE_BATCH}, pinned={"batch": {3}}
    )
    assert planner.plan({"a": (3, 8), "b": (3, 8)}).bucket == {"a": (3, 8), "b": (3, 8)}
    assert planner.plan({"a": (4, 8), "b": (4, 8)}).bucket == {"a": ("batch@2..4", 8), "b": ("batch@2..4", 8)}


@pytest.mark.parametrize("safety", [AxisSafety(axis="batch", safe=False, reason="t", probe_failed=True), None])
def test_exact_when_the_probe_could_not_run_or_the_policy_says_so(two_input_signature, safety):
    planner = _planner(two_input_signature, safety=safety)
    if safety is None:
        planner = BucketPlanner(two_input_signature, {"batch": AxisPolicy(kind="exact")}, {"batch": SAFE_BATCH})
    assert planner.effective_policy("batch").kind == "exact"
    assert planner.plan({"a": (3, 8), "b": (3, 8)}).bucket == {"a": (3, 8), "b": (3, 8)}


@pytest.mark.parametrize(
    "size, expected", [(1, (1, 1)), (2, (2, 4)), (48, (17, 64)), (64, (17, 64)), (65, (65, 256)), (800, (257, 1000))]
)
def test_dynamic_ranges_of_a_span(size, expected):
    assert AxisPolicy(kind="dynamic", min=1, max=1000, span=4).dynamic_range(size) == expected
    assert AxisPolicy(kind="dynamic", min=8, max=1000).dynamic_range(size) == (8, 1000)


@pytest.mark.parametrize(
    "dim, axis, sizes, step",
    [
        ("W@17..64", "W", (17, 64), 1),
        ("W", "W", None, 1),
        ("a@b", "a", None, 1),
        ("H@480..960:32", "H", (480, 960), 32),
    ],
)
def test_a_symbolic_dim_names_its_axis_range_and_step(dim, axis, sizes, step):
    assert (dim_axis(dim), dim_range(dim), dim_step(dim)) == (axis, sizes, step)


def test_exact_without_a_policy(two_input_signature):
    planner = BucketPlanner(two_input_signature, None, {"batch": SAFE_BATCH})
    assert planner.plan({"a": (5, 8), "b": (5, 8)}).bucket == {"a": (5, 8), "b": (5, 8)}


def test_pads_when_the_safety_check_passed(two_input_signature):
    plan = _planner(two_input_signature).plan({"a": (3, 8), "b": (3, 8)})
    assert isinstance(plan, BucketPlan)
    assert plan.request == {"a": (3, 8), "b": (3, 8)}
    assert plan.bucket == {"a": (4, 8), "b": (4, 8)}
    assert plan.request_axes == {"batch": 3}
    assert plan.bucket_axes == {"batch": 4}
    assert plan.padded_axes == {"batch": 3}
    assert bucket_label(plan.bucket) == "a=4x8,b=4x8"


def test_bucket_label_is_sorted():
    assert bucket_label({"z": (1,), "a": (2, 3)}) == "a=2x3,z=1"


def test_padding_waste(two_input_signature):
    plan = _planner(two_input_signature).plan({"a": (5, 8), "b": (5, 8)})
    assert plan.bucket == {"a": (8, 8), "b": (8, 8)}
    assert plan.padding_waste() == pytest.approx((128 - 80) / 128)
    assert _planner(two_input_signature).plan({"a": (8, 8), "b": (8, 8)}).padding_waste() == 0.0


def test_shared_axis_mismatch(two_input_signature):
    with pytest.raises(BadRequestError, match=r"axis 'batch' is 3 in one input and 5 in 'b'") as info:
        _planner(two_input_signature).plan({"a": (3, 8), "b": (5, 8)})
    assert info.value.http_status == 400


def test_wrong_rank_names_the_input(two_input_signature):
    with pytest.raises(BadRequestError, match=r"input 'b' has rank 3, expected 2"):
        _planner(two_input_signature).plan({"a": (3, 8), "b": (3, 8, 1)})


def test_static_dim_mismatch_names_the_input(two_input_signature):
    with pytest.raises(BadRequestError, match=r"input 'a' axis 1 is 7, the model fixes it at 8"):
        _planner(two_input_signature).plan({"a": (3, 7), "b": (3, 8)})


def test_zero_size_is_rejected(two_input_signature):
    with pytest.raises(BadRequestError, match=r"input 'a' axis 0 \(batch\) must be >= 1"):
        _planner(two_input_signature).plan({"a": (0, 8), "b": (0, 8)})


def test_missing_input_names_it(two_input_signature):
    with pytest.raises(BadRequestError, match=r"missing input 'b'"):
        _planner(two_input_signature).plan({"a": (3, 8)})


def test_unknown_input_names_it(two_input_signature):
    with pytest.raises(BadRequestError, match=r"unknown input 'c'"):
        _planner(two_input_signature).plan({"a": (3, 8), "b": (3, 8), "c": (3, 8)})


def test_overflow_error(two_input_signature):
    planner = _planner(two_input_signature, AxisPolicy(kind="pow2", max=8))
    with pytest.raises(ShapeOutOfRangeError, match=r"axis 'batch' size 9 is beyond the largest bucket \(8\)") as info:
        planner.plan({"a": (9, 8), "b": (9, 8)})
    assert isinstance(info.value, BadRequestError)
    assert info.value.http_status == 400


def test_overflow_error_for_a_list_policy(two_input_signature):
    planner = _planner(two_input_signature, AxisPolicy(kind="list", sizes=[2, 6]))
    assert planner.plan({"a": (3, 8), "b": (3, 8)}).bucket_axes == {"batch": 6}
    with pytest.raises(ShapeOutOfRangeError, match=r"beyond the largest bucket \(6\)"):
        planner.plan({"a": (7, 8), "b": (7, 8)})


def test_overflow_exact(two_input_signature):
    planner = _planner(two_input_signature, AxisPolicy(kind="pow2", max=8), overflow="exact")
    plan = planner.plan({"a": (9, 8), "b": (9, 8)})
    assert plan.bucket == {"a": (9, 8), "b": (9, 8)}
    assert plan.padded_axes == {}
    # Below the largest bucket it still pads.
    assert planner.plan({"a": (5, 8), "b": (5, 8)}).bucket_axes == {"batch": 8}


def test_unnamed_axes_are_planned_independently():
    signature = read_signature(onnx.load_from_string(synthetic.relu_model([None, None])))
    plan = BucketPlanner(signature).plan({"x": (3, 5)})
    assert plan.request_axes == {"x:0": 3, "x:1": 5}
    assert plan.bucket == {"x": (3, 5)}


# --- pad / unpad ------------------------------------------------------------


def test_pad_inputs_pads_at_the_end_with_the_pad_value():
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    padded = pad_inputs({"x": array}, {"x": (4, 3)}, {"x": -1.0})["x"]
    assert padded.shape == (4, 3)
    assert padded.dtype == np.float32
    np.testing.assert_array_equal(padded[:2], array)
    assert (padded[2:] == -1.0).all()


def test_pad_inputs_keeps_exact_arrays():
    array = np.ones((4, 3), dtype=np.int64)
    assert pad_inputs({"x": array}, {"x": (4, 3)})["x"] is array


def test_pad_and_unpad_round_trip_through_onnxruntime(two_input_signature):
    engine = OrtEngine(synthetic.two_input_model(), threads=1)
    planner = _planner(two_input_signature)
    rng = np.random.default_rng(7)
    inputs = {name: rng.standard_normal((3, 8)).astype(np.float32) for name in ("a", "b")}

    plan = planner.plan({name: array.shape for name, array in inputs.items()})
    padded = planner.pad(inputs, plan)
    assert {name: array.shape for name, array in padded.items()} == {"a": (4, 8), "b": (4, 8)}

    padded_outputs = engine.run(padded)
    assert padded_outputs["y"].shape == (4, 8)
    outputs = planner.unpad(padded_outputs, plan)
    expected = engine.run(inputs)
    assert outputs["y"].shape == (3, 8)
    np.testing.assert_allclose(outputs["y"], expected["y"], rtol=1e-5, atol=1e-6)


def test_unpad_leaves_exact_plans_alone(two_input_signature):
    planner = _planner(two_input_signature)
    plan = planner.plan({"a": (4, 8), "b": (4, 8)})
    outputs = {"y": np.zeros((4, 8), dtype=np.float32)}
    assert planner.unpad(outputs, plan)["y"].shape == (4, 8)


def test_pow2_max_that_is_not_a_power_of_two():
    try:
        policy = AxisPolicy(kind="pow2", max=48)
    except ValidationError:
        return  # refusing such a policy up front is a fine fix too
    bucket = policy.bucket_size(40)
    assert bucket is not None
    assert 40 <= bucket <= 48


def test_typical_request_is_halfway_into_each_padded_axis(two_input_signature):
    safe = AxisSafety(axis="batch", safe=True, reason="ok")
    planner = BucketPlanner(two_input_signature, {"batch": AxisPolicy(kind="pow2", max=64)}, {"batch": safe})
    assert planner.typical_request({"a": (8, 8), "b": (8, 8)}) == {"a": (7, 8), "b": (7, 8)}  # 5..8 serve it
    assert planner.typical_request({"a": (1, 8), "b": (1, 8)}) == {"a": (1, 8), "b": (1, 8)}
    listed = BucketPlanner(two_input_signature, {"batch": AxisPolicy(kind="list", sizes=[4, 100])}, {"batch": safe})
    assert listed.typical_request({"a": (100, 8), "b": (100, 8)})["a"] == (53, 8)
    exact = BucketPlanner(two_input_signature)
    assert exact.typical_request({"a": (6, 8), "b": (6, 8)}) == {"a": (6, 8), "b": (6, 8)}


# --- the dynamic-shape tier ---------------------------------------------------


@pytest.fixture(scope="module")
def batch_width_planner() -> BucketPlanner:
    """``x[batch, 3, W]``: batch padded to powers of two, W dynamic within 8..256."""
    signature = read_signature(onnx.load_from_string(synthetic.relu_model(["batch", 3, "W"])))
    policies = {"batch": AxisPolicy(kind="pow2", max=8), "W": AxisPolicy(kind="dynamic", min=8, max=256)}
    safety = {"batch": AxisSafety(axis="batch", safe=True, reason="test", output_axes={"y": [0]})}
    return BucketPlanner(signature, policies, safety)


def test_a_dynamic_axis_keeps_its_name_within_its_range(batch_width_planner):
    plan = batch_width_planner.plan({"x": (3, 3, 100)})
    assert plan.bucket == {"x": (4, 3, "W@8..256")}
    assert bucket_label(plan.bucket) == "x=4x3xW@8..256"
    assert plan.run_shapes == {"x": (4, 3, 100)}
    assert plan.padded_axes == {"batch": 3}  # W is never padded
    assert plan.padding_waste() == pytest.approx(1 / 4)
    assert (
        batch_width_planner.plan({"x": (4, 3, 8)}).bucket
        == plan.bucket
        == batch_width_planner.plan({"x": (3, 3, 256)}).bucket
    )


@pytest.mark.parametrize("width", [7, 257, 1000])
def test_a_dynamic_axis_outside_its_range_is_served_exactly(batch_width_planner, width):
    assert batch_width_planner.plan({"x": (1, 3, width)}).bucket == {"x": (1, 3, width)}


def test_a_dynamic_bucket_pads_only_its_padded_axes(batch_width_planner):
    x = np.arange(2 * 3 * 10, dtype=np.float32).reshape(2, 3, 10)
    plan = batch_width_planner.plan({"x": x.shape})
    padded = batch_width_planner.pad({"x": x}, plan)["x"]
    assert padded.shape == (2, 3, 10)
    plan = batch_width_planner.plan({"x": (3, 3, 10)})
    assert batch_width_planner.pad({"x": np.ones((3, 3, 10), np.float32)}, plan)["x"].shape == (4, 3, 10)


def test_a_dynamic_bucket_is_verified_and_timed_within_its_range(batch_width_planner):
    bucket = {"x": (4, 3, "W@8..256")}
    # the ends, the middle, and the tails of 64: 0, 1 over, 1 and 7 under
    assert batch_width_planner.verify_sizes(bucket) == {"W@8..256": [8, 132, 249, 255, 256]}
    assert batch_width_planner.typical_request(bucket) == {"x": (4, 3, 132)}
    assert batch_width_planner.most_padded_request(bucket) == {"x": (3, 3, 8)}


@pytest.mark.parametrize(
    "low, high, tails",
    [
        (48, 800, [761, 767, 768, 769]),
        (8, 256, [249, 255, 256]),
        (1, 64, [57, 63, 64]),
        (60, 100, [63, 64, 65]),
        (1, 40, []),
    ],
)
def test_tail_sizes_leave_every_remainder_of_the_vector_tiles(low, high, tails):
    assert tail_sizes(low, high) == tails


@pytest.mark.parametrize("fields", [{"min": 64, "max": 8}, {"approximate": 0.1}])
def test_bad_dynamic_policies_are_rejected(fields):
    with pytest.raises(ValidationError):
        AxisPolicy(kind="dynamic", **fields)


@pytest.fixture(scope="module")
def detector_planner() -> BucketPlanner:
    """``x[1, 3, H, W]``, both dynamic within 480..960 in steps of 32 (a detector's input)."""
    signature = read_signature(onnx.load_from_string(synthetic.relu_model([1, 3, "H", "W"])))
    policy = AxisPolicy(kind="dynamic", min=480, max=960, step=32)
    return BucketPlanner(signature, {"H": policy, "W": policy})


def test_a_stepped_dynamic_axis_serves_its_multiples_and_serves_other_sizes_exactly(detector_planner):
    assert detector_planner.plan({"x": (1, 3, 640, 512)}).bucket == {"x": (1, 3, "H@480..960:32", "W@480..960:32")}
    assert detector_planner.plan({"x": (1, 3, 480, 960)}).bucket == {"x": (1, 3, "H@480..960:32", "W@480..960:32")}
    assert detector_planner.plan({"x": (1, 3, 650, 512)}).bucket == {"x": (1, 3, 650, "W@480..960:32")}
    assert detector_planner.plan({"x": (1, 3, 448, 992)}).bucket == {"x": (1, 3, 448, 992)}


def test_a_stepped_dynamic_bucket_is_verified_and_timed_at_multiples_only(detector_planner):
    bucket = {"x": (1, 3, "H@480..960:32", "W@480..960:32")}
    # counts 15..30: the ends, the middle (23), and the tails of 16 (15, 16, 17) where the count is a map's width
    sizes = [480, 512, 544, 736, 960]
    assert detector_planner.verify_sizes(bucket) == {"H@480..960:32": sizes, "W@480..960:32": sizes}
    assert detector_planner.typical_request(bucket) == {"x": (1, 3, 704, 704)}


@pytest.mark.parametrize("size, expected", [(100, (96, 256)), (480, (288, 992)), (64, (32, 64))])
def test_a_stepped_dynamic_range_ends_on_its_step(size, expected):
    assert AxisPolicy(kind="dynamic", min=32, max=1000, span=4, step=32).dynamic_range(size) == expected
