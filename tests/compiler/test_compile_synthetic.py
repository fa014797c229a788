"""Real TVM compiles of small onnx.helper models, verified against ONNX Runtime."""

from __future__ import annotations

import os
import signal

import pytest

from compiler.building.build import compile_bucket
from compiler.building.options import CompileOptions, CompileSettings
from compiler.building.target import resolve_target
from compiler.errors import CompileCrashedError, CompileOutOfMemoryError, UnsupportedOperatorError
from compiler.models.model import load_model
from compiler.storage.store import KernelStore
from tests import synthetic


@pytest.fixture
def store(tmp_path):
    return KernelStore(tmp_path / "kernels")


def _load(data: bytes):
    return load_model(data, max_bytes=1 << 20)


@pytest.mark.parametrize("dtype", ["float32", "float16", "int64"])
def test_elementwise_model_per_dtype(store, dtype):
    outcome = compile_bucket(_load(synthetic.add_model(dtype)), {"x": (4, 4)}, resolve_target("llvm"), store)
    assert outcome.manifest.verified is True, outcome.manifest.verification
    assert outcome.manifest.bucket == {"x": [4, 4]}


def test_the_manifest_times_every_stage(store):
    outcome = compile_bucket(_load(synthetic.relu_model([2, 8])), {"x": (2, 8)}, resolve_target("llvm"), store)
    manifest = outcome.manifest
    stages = manifest.compile_stages
    assert list(stages) == [
        "load", "simplify", "import", "dispatch", "layout", "legalize", "fold_constants", "fuse",
        "apply_tuning_records", "schedule", "lower", "codegen", "export", "explain", "verify",
    ]  # fmt: skip
    assert all(seconds >= 0 for seconds in stages.values())
    assert stages["codegen"] > 0 and stages["export"] > 0  # LLVM and the linker did run
    without_verify = sum(seconds for stage, seconds in stages.items() if stage != "verify")
    assert without_verify == pytest.approx(manifest.compile_seconds, abs=0.02)
    assert store.get(manifest.key).compile_stages == stages  # kept with the artifact


def test_two_inputs_sharing_a_named_axis(store):
    model = _load(synthetic.two_input_model())
    outcome = compile_bucket(model, {"a": (2, 8), "b": (2, 8)}, resolve_target("llvm"), store)
    assert outcome.manifest.verified is True, outcome.manifest.verification


def test_unnamed_dynamic_axis(store):
    model = _load(synthetic.unnamed_axis_model())
    outcome = compile_bucket(model, {"x": (3, 6)}, resolve_target("llvm"), store)
    assert outcome.manifest.verified is True, outcome.manifest.verification


def test_unsupported_operator_fails_cleanly_naming_the_op(store):
    model = _load(synthetic.unsupported_op_model())
    with pytest.raises(UnsupportedOperatorError, match="Det"):
        compile_bucket(model, {"x": (2, 3, 3)}, resolve_target("llvm"), store)
    assert list(store.keys()) == []
    assert list(store.staging_root.iterdir()) == []


def _crash(job):
    os.kill(os.getpid(), signal.SIGSEGV)


def test_crashing_compile_child_fails_that_compile_only(store):
    model = _load(synthetic.add_model("float32"))
    target = resolve_target("llvm")
    with pytest.raises(CompileCrashedError, match="SIGSEGV"):
        compile_bucket(model, {"x": (2, 4)}, target, store, builder=_crash)
    assert list(store.keys()) == []
    assert list(store.staging_root.iterdir()) == []
    # The caller goes on: the same key compiles normally afterwards.
    outcome = compile_bucket(model, {"x": (2, 4)}, target, store)
    assert outcome.manifest.verified is True


def test_a_compile_past_its_memory_limit_fails_as_out_of_memory_leaving_nothing(store):
    model = _load(synthetic.add_model("float32"))
    target = resolve_target("llvm")
    tight = CompileOptions(memory_limit_bytes=64 * 1024**2)  # importing TVM alone takes more
    with pytest.raises(CompileOutOfMemoryError, match="memory limit of 67108864 bytes"):
        compile_bucket(model, {"x": (2, 4)}, target, store, tight)
    assert list(store.keys()) == []
    assert list(store.staging_root.iterdir()) == []
    roomy = CompileOptions(memory_limit_bytes=CompileSettings().compile_memory_bytes)
    assert compile_bucket(model, {"x": (2, 4)}, target, store, roomy).manifest.verified is True


def test_an_embedding_smaller_than_the_test_ids_verifies(store):
    # Verification inputs stay inside the table: ids 0..7 would be refused by ONNX Runtime here.
    model = _load(synthetic.embedding_model(vocab=3))
    outcome = compile_bucket(model, {"ids": (2, 8)}, resolve_target("llvm"), store)
    assert outcome.manifest.verified is True, outcome.manifest.verification


def test_a_conv_at_batch_4_makes_no_more_code_than_at_batch_1(store):
    """Code size stands in for compile time (tests are not timed): a padded image unrolled whole
    once made the batch-4 kernel of a detector 30x slower to compile than batch 1."""
    model, target = _load(synthetic.conv_model()), resolve_target("llvm", num_cores=2)
    sizes = {}
    for batch in (1, 4):
        manifest = compile_bucket(model, {"x": (batch, 3, 96, 96)}, target, store).manifest
        assert manifest.verified is True, manifest.verification
        sizes[batch] = manifest.library_bytes
    assert sizes[4] < 1.5 * sizes[1], sizes


@pytest.mark.parametrize(
    ("data", "bucket", "sizes"),
    [
        (synthetic.mean_mix_model(), {"x": (1, 8, "W")}, {"W": [17, 64, 333]}),
        (synthetic.conv_model(size=24), {"x": ("N", 3, 24, 24)}, {"N": [1, 3, 5]}),
    ],
    ids=["reduction-over-W", "conv-over-N"],
)
def test_one_dynamic_kernel_serves_every_size(store, data, bucket, sizes):
    """The dynamic-shape tier: a named dim stays symbolic, one kernel runs every size of it."""
    import numpy as np

    from compiler.building.build import open_kernel
    from compiler.running.engines import OrtEngine

    model = _load(data)
    outcome = compile_bucket(model, bucket, resolve_target("llvm"), store, verify_sizes=sizes)
    manifest = outcome.manifest
    assert manifest.verified is True, manifest.verification
    assert manifest.bucket == {"x": list(bucket["x"])}
    name = next(iter(sizes))
    assert manifest.verification.count(";") == 3  # all three sizes checked, and all-zero inputs
    kernel = open_kernel(model, outcome, store)
    reference = OrtEngine(data)
    for size in (2, 40, 101):  # sizes it was not verified at
        shape = tuple(size if d == name else d for d in bucket["x"])
        x = {"x": np.random.default_rng(size).standard_normal(shape).astype(np.float32)}
        np.testing.assert_allclose(kernel.run(x)["y"], reference.run(x)["y"], rtol=1e-3, atol=1e-4)


def test_a_symbolic_bucket_without_verification_sizes_is_refused(store):
    from compiler.errors import CompileError

    with pytest.raises(CompileError, match=r"needs verification sizes for \['W'\]"):
        compile_bucket(_load(synthetic.mean_mix_model()), {"x": (1, 8, "W")}, resolve_target("llvm"), store)
    assert list(store.keys()) == []
