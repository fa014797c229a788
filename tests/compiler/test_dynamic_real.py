"""Real models in the dynamic tier, as a model uploaded with no config lands there: each spatial axis
symbolic over the range a request's size falls in, verified against ONNX Runtime at the sizes the
server verifies (:meth:`BucketPlanner.verify_sizes`) and checked at sizes it was not verified at."""

from __future__ import annotations

import numpy as np
import pytest

from compiler.building.build import compile_bucket, open_kernel
from compiler.building.target import resolve_target
from compiler.models.model import load_model_file
from compiler.running.engines import OrtEngine
from compiler.shapes.buckets import BucketPlanner
from compiler.storage.store import KernelStore
from tests.realmodels import CLS, real_model

pytestmark = pytest.mark.slow

TARGET = resolve_target("llvm")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return KernelStore(tmp_path_factory.mktemp("kernels"))


def compile_dynamic(store: KernelStore, name: str, bucket: dict):
    model = load_model_file(str(real_model(name)), max_bytes=64 << 20)
    sizes = BucketPlanner(model.signature, {}).verify_sizes(bucket)
    outcome = compile_bucket(model, bucket, TARGET, store, verify_sizes=sizes)
    return model, outcome, sizes


def matches_onnxruntime(model, outcome, store, shapes: list[tuple[int, ...]], tolerance: float) -> None:
    kernel, reference = open_kernel(model, outcome, store), OrtEngine(model.data)
    name = model.signature.inputs[0].name
    for shape in shapes:
        x = {name: np.random.default_rng(sum(shape)).random(shape, dtype=np.float32)}
        for output, want in reference.run(x).items():
            assert np.isfinite(want).all()
            np.testing.assert_allclose(kernel.run(x)[output], want, rtol=tolerance, atol=tolerance, err_msg=str(shape))


def test_cls_height_17_to_64_kernel_verifies_at_its_low_edge(store):
    """PP-OCR cls's last map is one row high at heights 17..32 and its 2x2 MaxPool took none of it (TVM
    divides the pool's size by floor, ONNX Runtime toward zero): the kernel answered NaN at height 17
    and was refused."""
    height, width = "x:2@17..64", "x:3@65..256"
    model, outcome, sizes = compile_dynamic(store, CLS, {"x": (1, 3, height, width)})
    assert 17 in sizes[height], sizes
    assert outcome.manifest.verified is True, outcome.manifest.verification
    matches_onnxruntime(
        model, outcome, store, [(1, 3, 17, 100), (1, 3, 32, 65), (1, 3, 33, 200), (1, 3, 48, 192)], 1e-4
    )
