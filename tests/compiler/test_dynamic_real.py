"""A real detector in the dynamic tier, as a model uploaded with no config lands there: each spatial
axis symbolic over the range a request's size falls in, verified against ONNX Runtime and checked at
sizes it was not verified at. PP-OCR cls's dynamic kernel (heights 17..64) is served and checked the
same way in ``tests/integration/test_ocr_no_config.py``."""

from __future__ import annotations

import numpy as np
import pytest

from compiler.building.build import compile_bucket, open_kernel
from compiler.building.target import resolve_target
from compiler.models.model import load_model_file
from compiler.running.engines import OrtEngine
from compiler.storage.store import KernelStore
from tests.realmodels import DETECTOR, real_model

pytestmark = pytest.mark.slow

TARGET = resolve_target("llvm")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return KernelStore(tmp_path_factory.mktemp("kernels"))


def matches_onnxruntime(model, outcome, store, shapes: list[tuple[int, ...]], *, rtol: float, atol: float) -> None:
    kernel, reference = open_kernel(model, outcome, store), OrtEngine(model.data)
    name = model.signature.inputs[0].name
    for shape in shapes:
        x = {name: np.random.default_rng(sum(shape)).random(shape, dtype=np.float32)}
        for output, want in reference.run(x).items():
            assert np.isfinite(want).all()
            np.testing.assert_allclose(kernel.run(x)[output], want, rtol=rtol, atol=atol, err_msg=str(shape))


def test_yolov8n_height_and_width_257_to_1024_kernel_imports_verifies_and_refuses_as_onnxruntime(store):
    """Over plain symbolic dims the detector's 2x upsample of a level meets the level above in a Concat
    TVM cannot prove consistent, and its anchor grid (a float Range over a map's width) got a length of
    its own: import failed (``object of type 'NoneType' has no len()``). Its neck agrees at heights
    (and widths) 25..32 mod 32 only, as ONNX Runtime's does: the kernel answers there and refuses the
    rest. It is verified at sizes the model takes (the server's own sizes for this range include some it
    refuses: 257, 641)."""
    height, width = "height@257..1024", "width@257..1024"
    model = load_model_file(str(real_model(DETECTOR)), max_bytes=64 << 20)
    sizes = {height: [281, 320, 1024], width: [1024, 313, 288]}
    outcome = compile_bucket(model, {"images": (1, 3, height, width)}, TARGET, store, verify_sizes=sizes)
    assert outcome.manifest.verified is True, outcome.manifest.verification
    matches_onnxruntime(model, outcome, store, [(1, 3, 288, 281), (1, 3, 640, 320)], rtol=1e-3, atol=1e-2)
    kernel, reference = open_kernel(model, outcome, store), OrtEngine(model.data)
    x = {"images": np.zeros((1, 3, 257, 320), np.float32)}
    with pytest.raises(Exception):  # noqa: B017 - ONNX Runtime's error and the VM's are their own types
        reference.run(x)
    with pytest.raises(Exception):  # noqa: B017
        kernel.run(x)
