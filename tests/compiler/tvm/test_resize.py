"""A bilinear Resize in two passes (compiler/tvm/resize.py): the columns of each input row first, kept as a
stage of its own, then the rows; verified against ONNX Runtime in each coordinate mode it takes."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from compiler.building.build import compile_bucket
from compiler.building.target import resolve_target
from compiler.models.model import load_model
from compiler.storage.store import KernelStore
from tests.synthetic import make_model, value

tvm = pytest.importorskip("tvm")

from compiler.tvm.build import import_relax, specialize  # noqa: E402
from compiler.tvm.pipeline import tuned_module_stages  # noqa: E402
from compiler.tvm.schedules import Injective  # noqa: E402

TARGET = resolve_target("llvm")


def _resize_model(mode: str, size: int, out_size: int) -> bytes:
    """Relu(x) resized from size x size to out_size x out_size, bilinear, in ``mode``; the Relu fuses in
    front of the resize as DeepLabV3's classifier bias does."""
    sizes = numpy_helper.from_array(np.array([1, 4, out_size, out_size], np.int64), "sizes")
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Resize", ["r", "", "", "sizes"], ["y"], mode="linear", coordinate_transformation_mode=mode),
    ]
    graph = helper.make_graph(
        nodes,
        "resize",
        [value("x", "float32", [1, 4, size, size])],
        [value("y", "float32", [1, 4, out_size, out_size])],
        initializer=[sizes],
    )
    return make_model(graph).SerializeToString()


def _resize_kernel(model: bytes, bucket: dict):
    specialized, _ = specialize(onnx.load_from_string(model), bucket, True)
    mod = import_relax(specialized, bucket, {"x": "float32"})
    target = tvm.target.Target(TARGET)
    with target:
        mod = tvm.transform.Sequential([p for _, stage in tuned_module_stages(target) for p in stage])(mod)
    return next(f for gv, f in mod.functions_items() if "resize" in gv.name_hint), target


@pytest.mark.parametrize(
    ("mode", "size", "out_size"),
    [("half_pixel", 14, 224), ("align_corners", 7, 30), ("asymmetric", 16, 8), ("pytorch_half_pixel", 5, 12)],
)
def test_a_bilinear_resize_runs_in_two_passes_and_verifies(mode, size, out_size, tmp_path):
    model = _resize_model(mode, size, out_size)
    bucket = {"x": (1, 4, size, size)}
    func, target = _resize_kernel(model, bucket)
    script = Injective().apply(func, target, False).mod["main"].script()
    # Two passes where the coordinate mode is TOPI's affine one; TOPI's own resize otherwise.
    assert ('T.sblock("resize_columns")' in script) == (mode != "pytorch_half_pixel"), script
    outcome = compile_bucket(load_model(model, max_bytes=1 << 20), bucket, TARGET, KernelStore(tmp_path))
    assert outcome.manifest.verified is True, outcome.manifest.verification
