"""compiler.shapes.padding.check_axis_padding with onnxruntime as the engine."""

from __future__ import annotations

import threading

import onnx
import pytest

from compiler.errors import UnavailableError
from compiler.models.signature import read_signature
from compiler.running.engines import OrtEngine
from compiler.shapes.buckets import AxisPolicy, BucketPlanner
from compiler.shapes.padding import check_axis_padding, default_probe_sizes, probe_padding
from tests import synthetic


def _engine_and_signature(data: bytes):
    return OrtEngine(data, threads=1), read_signature(onnx.load_from_string(data))


def test_batch_axis_of_two_input_model_is_safe():
    engine, signature = _engine_and_signature(synthetic.two_input_model())
    safety = check_axis_padding(engine, signature, "batch", {"batch": 3}, 4)
    assert safety.safe, safety.reason
    assert safety.axis == "batch"
    assert safety.output_axes == {"y": [0]}
    assert "3 -> 4" in safety.reason
    assert safety.max_abs_error is not None
    assert safety.max_abs_error < 1e-5


def test_safe_result_drives_the_planner():
    engine, signature = _engine_and_signature(synthetic.two_input_model())
    safety = check_axis_padding(engine, signature, "batch", {"batch": 2}, 8)
    planner = BucketPlanner(signature, {"batch": AxisPolicy(kind="pow2", max=8)}, {"batch": safety})
    assert planner.plan({"a": (5, 8), "b": (5, 8)}).bucket == {"a": (8, 8), "b": (8, 8)}


@pytest.mark.parametrize("dtype", ["float32", "float16", "int64"])
def test_elementwise_batch_axis_is_safe_for_each_dtype(dtype):
    engine, signature = _engine_and_signature(synthetic.add_model(dtype))
    safety = check_axis_padding(engine, signature, "batch", {"batch": 5}, 8)
    assert safety.safe, safety.reason
    assert safety.output_axes == {"y": [0]}


def test_unnamed_axis_is_checked_by_its_generated_name():
    engine, signature = _engine_and_signature(synthetic.unnamed_axis_model())
    safety = check_axis_padding(engine, signature, "x:0", {"x:0": 1}, 2)
    assert safety.safe, safety.reason
    assert safety.output_axes == {"y": [0]}


def test_batch_mixing_model_is_unsafe():
    engine, signature = _engine_and_signature(synthetic.batch_mix_model())
    safety = check_axis_padding(engine, signature, "batch", {"batch": 3}, 4)
    assert not safety.safe
    assert "padding changes the outputs" in safety.reason
    assert "'y' differs" in safety.reason
    assert safety.output_axes == {"y": [0]}
    assert safety.max_abs_error is not None
    assert safety.max_abs_error > 1e-3


def test_an_unsafe_result_never_pads_the_axis():
    """Padding would change the outputs: the planner keeps the axis symbolic (the dynamic tier), unpadded."""
    engine, signature = _engine_and_signature(synthetic.batch_mix_model())
    safety = check_axis_padding(engine, signature, "batch", {"batch": 3}, 4)
    planner = BucketPlanner(signature, {"batch": AxisPolicy()}, {"batch": safety})
    plan = planner.plan({"x": (3, 4)})
    assert plan.bucket == {"x": ("batch@2..4", 4)}
    assert plan.run_shapes == {"x": (3, 4)}
    assert plan.padded_axes == {}


def test_padded_size_must_exceed_the_exact_size():
    engine, signature = _engine_and_signature(synthetic.two_input_model())
    with pytest.raises(ValueError, match="must exceed"):
        check_axis_padding(engine, signature, "batch", {"batch": 4}, 4)


class _FailingEngine:
    name = "failing"

    def run(self, inputs):
        raise RuntimeError("shape not supported")


def test_engine_failure_is_reported_as_unsafe():
    signature = read_signature(onnx.load_from_string(synthetic.two_input_model()))
    safety = check_axis_padding(_FailingEngine(), signature, "batch", {"batch": 3}, 4)
    assert not safety.safe
    assert "RuntimeError: shape not supported" in safety.reason


def test_output_axis_not_following_the_input_axis_is_unsafe():
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Flatten", ["x"], ["y"], axis=0)],
        "flatten",
        [synthetic.value("x", "float32", ["batch", 4])],
        [synthetic.value("y", "float32", [1, None])],
    )
    engine, signature = _engine_and_signature(synthetic.make_model(graph).SerializeToString())
    safety = check_axis_padding(engine, signature, "batch", {"batch": 3}, 4)
    assert not safety.safe
    assert "axis 1 goes 12 -> 16" in safety.reason
    assert "not cut back 1:1" in safety.reason


def test_probe_tries_larger_sizes_when_the_model_refuses_the_first():
    engine, signature = _engine_and_signature(synthetic.scalar_input_model(pad=64))
    policies = {axis: AxisPolicy(kind="pow2", max=1024) for axis in ("batch", "samples")}
    results = probe_padding(engine, signature, policies, {"batch": 3, "samples": 32})
    assert results["batch"].safe, results["batch"].reason
    samples = results["samples"]
    assert not samples.probe_failed  # probed at 128: a reflect pad of 64 needs more than 64 samples
    assert not samples.safe and "not cut back 1:1" in samples.reason


def test_an_axis_no_size_works_for_names_the_config_field():
    engine, signature = _engine_and_signature(synthetic.scalar_input_model(pad=64))
    policies = {axis: AxisPolicy(kind="pow2", max=1024) for axis in ("batch", "samples")}
    results = probe_padding(engine, signature, policies, {"batch": 3, "samples": 32}, configured={"samples"})
    samples = results["samples"]
    assert samples.probe_failed and not samples.safe
    assert samples.reason.startswith("could not probe axis 'samples': the model fails at sizes [32]")
    assert 'probe_sizes {"samples": N}' in samples.reason


@pytest.mark.parametrize(
    ("tolerance", "safe"), [(None, False), (0.05, True), (1e-6, False)], ids=["not-approximate", "within", "beyond"]
)
def test_approximate_policy_pads_within_its_tolerance(tolerance, safe):
    engine, signature = _engine_and_signature(synthetic.mean_mix_model())
    safety = check_axis_padding(engine, signature, "W", {"W": 20}, 32, tolerance=tolerance)
    assert (safety.safe, safety.approximate) == (safe, safe)
    assert 1e-4 < safety.max_abs_error < 0.05  # the mean over 20 of 32 columns, times 0.01
    if tolerance is None:
        assert safety.reason.startswith("padding changes the outputs")
    elif safe:
        assert safety.reason == (
            f"approximate: padding 20 -> 32 changes the outputs by up to {safety.max_abs_error:.3g} (tolerance 0.05)"
        )
        assert safety.output_axes == {"y": [2]}
    else:
        assert safety.reason.endswith("beyond the tolerance 1e-06")


def test_approximate_needs_a_padding_policy():
    with pytest.raises(ValueError, match="'exact' policy never pads"):
        AxisPolicy(kind="exact", approximate=0.1)
    policies = {"W": AxisPolicy(kind="pow2", min=8, max=64, approximate=0.05)}
    engine, signature = _engine_and_signature(synthetic.mean_mix_model())
    safety = probe_padding(engine, signature, policies, {"W": 20})
    planner = BucketPlanner(signature, policies, safety)
    assert planner.approximate_tolerance({"x": (1, 8, 32)}) == 0.05
    assert planner.most_padded_request({"x": (1, 8, 32)}) == {"x": (1, 8, 17)}
    assert planner.plan({"x": (1, 8, 20)}).bucket == {"x": (1, 8, 32)}


def test_probe_stops_at_its_time_budget():
    engine, signature = _engine_and_signature(synthetic.many_inputs_model(200))
    policies = {axis: AxisPolicy(kind="pow2", max=64) for axis in signature.axes()}
    results = probe_padding(engine, signature, policies, dict.fromkeys(signature.axes(), 3), seconds=0.2)
    assert len(results) == 200
    skipped = [r for r in results.values() if r.reason.endswith("ran out of its 0.2 s; served exactly")]
    assert 0 < len(skipped) < 200
    assert not any(r.safe for r in skipped)


def test_a_cancelled_probe_answers_503():
    engine, signature = _engine_and_signature(synthetic.two_input_model())
    cancelled = threading.Event()
    cancelled.set()
    with pytest.raises(UnavailableError, match="shutting down"):
        probe_padding(engine, signature, {"batch": AxisPolicy()}, {"batch": 3}, cancelled=cancelled)


def test_probe_sizes_over_the_input_limit_are_skipped():
    engine, signature = _engine_and_signature(synthetic.two_input_model())  # a, b: [batch, 8] float32
    policies = {"batch": AxisPolicy(kind="pow2", max=1024)}
    # 2 inputs x 8 floats per row: 512 bytes allows 16 rows; the probe of 32 (padded 64) and up is skipped
    results = probe_padding(engine, signature, policies, {"batch": 32}, max_input_bytes=512)
    # 32 rows do not fit: the probe runs at 1 row (padded to 2), then confirms at 3 (padded to 4)
    assert results["batch"].safe and results["batch"].reason == "outputs match after padding 1 -> 2"
    nothing = probe_padding(engine, signature, policies, {"batch": 32}, configured={"batch"}, max_input_bytes=512)
    assert nothing["batch"].reason.startswith("not probed: its probe sizes make inputs over 512 bytes")


def test_a_model_that_runs_at_one_height_and_width_keeps_its_batch_padded():
    engine, signature = _engine_and_signature(synthetic.fixed_size_model(32))
    policies = {axis: AxisPolicy(kind="pow2", max=1024) for axis in signature.axes()}
    results = probe_padding(engine, signature, policies, default_probe_sizes(signature))
    assert results["batch"].safe and results["batch"].reason == "outputs match after padding 3 -> 4"
    for axis in ("H", "W"):
        verdict = results[axis]
        assert verdict.probe_failed and not verdict.safe
        # its own sizes alone, the other axes at 32 (where the model runs): the node that refused them named
        assert verdict.reason.startswith(f"could not probe axis {axis!r}: the model fails at sizes [8, 16, 64, 128, ")
        assert "; it runs at 32 (" in verdict.reason and "fixed_grid_add" in verdict.reason
    planner = BucketPlanner(signature, policies, results)
    assert planner.effective_policy("batch").kind == "pow2"
    assert planner.effective_policy("H").kind == "exact" and planner.effective_policy("W").kind == "exact"


def test_axes_are_probed_at_sizes_a_convnet_really_sees():
    # From 224 (PP-OCR det's height and width looked padding-safe with maps of 64 or 128), the leading
    # (batch) axis from 3, a size the user gave from that
    engine, signature = _engine_and_signature(synthetic.conv_pool_model())
    sizes = default_probe_sizes(signature)
    assert sizes == {"N": 3, "H": 224, "W": 224}
    assert default_probe_sizes(signature, {"H": 48}) == {"N": 3, "H": 48, "W": 224}
    policies = {axis: AxisPolicy(kind="pow2", max=1024) for axis in signature.axes()}
    results = probe_padding(engine, signature, policies, sizes)
    assert results["N"].safe
    for axis in ("H", "W"):
        assert not results[axis].safe and results[axis].reason.startswith("padding changes the outputs")


def test_padding_found_harmless_is_confirmed_at_a_larger_size():
    # W <= 100 leaves the outputs alone: 48 -> 64 matches, 144 -> 256 is past the threshold on both sides
    engine, signature = _engine_and_signature(synthetic.long_axis_mix_model(threshold=100))
    policies = {axis: AxisPolicy(kind="pow2", max=1024) for axis in signature.axes()}
    results = probe_padding(engine, signature, policies, {"batch": 3, "W": 48})
    assert not results["W"].safe and results["W"].reason.startswith("padding changes the outputs")
