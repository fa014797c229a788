"""A quantized graph's layers share their kernels: its per-layer scales and zero points reach them as 0-d
tensor operands, not immediates, and the answers stay bit for bit. Legalization that builds each elementwise
kernel once gives the module TVM's own legalization gives."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from tvm import relax, tirx

from compiler.running.engines import TvmEngine
from compiler.tvm import legalize, pipeline
from compiler.tvm.build import compile_relax, import_relax
from compiler.tvm.shared_kernels import SHARED_ELEMENTWISE, scalar_operands_bound
from tests import synthetic
from tests.compiler.test_quantized import static_quantized_encoder

TARGET = {"kind": "llvm", "mcpu": "haswell", "num-cores": 2}
BUCKET = {"x": (1, 16, 64)}


def _imported(model: bytes) -> tvm.IRModule:
    return import_relax(onnx.load_from_string(model), BUCKET, {"x": "float32"})


def _through(mod: tvm.IRModule, last_stage: str) -> tvm.IRModule:
    target = tvm.target.Target(TARGET)
    with target:
        for name, passes in pipeline.tuned_module_stages(target):
            mod = tvm.transform.Sequential(passes)(mod)
            if name == last_stage:
                return mod
    raise AssertionError(last_stage)


def _kernels(mod: tvm.IRModule) -> int:
    return sum(isinstance(func, tirx.PrimFunc) for func in mod.functions.values())


@pytest.fixture(scope="module")
def encoders(tmp_path_factory) -> dict[int, bytes]:
    directory = tmp_path_factory.mktemp("encoders")
    return {layers: static_quantized_encoder(directory, layers=layers) for layers in (1, 2)}


def test_a_second_quantized_layer_adds_no_kernel(encoders):
    one, two = (_kernels(_through(_imported(encoders[layers]), "fuse")) for layers in (1, 2))
    assert two == one


def test_a_second_layer_added_kernels_with_its_scales_as_immediates(encoders, monkeypatch):
    # What the rewrite is for: without it, the second layer's scales made kernels of their own.
    monkeypatch.setattr(pipeline, "scalar_operands_pass", tvm.transform.Sequential([]))
    one, two = (_kernels(_through(_imported(encoders[layers]), "fuse")) for layers in (1, 2))
    assert two > one


def _answers(model: bytes, directory, x: np.ndarray) -> np.ndarray:
    library = directory / "kernel.so"
    compile_relax(_imported(model), TARGET).export_library(str(library))
    output = onnx.load_from_string(model).graph.output[0].name
    return TvmEngine(library, ["x"], [output]).run({"x": x})[output]


def test_the_shared_kernels_answer_bit_for_bit_as_the_per_layer_ones(encoders, tmp_path, monkeypatch):
    x = np.random.default_rng(7).standard_normal(BUCKET["x"]).astype(np.float32)
    (tmp_path / "shared").mkdir()
    (tmp_path / "per_layer").mkdir()
    shared = _answers(encoders[2], tmp_path / "shared", x)
    monkeypatch.setattr(pipeline, "scalar_operands_pass", tvm.transform.Sequential([]))
    per_layer = _answers(encoders[2], tmp_path / "per_layer", x)
    np.testing.assert_array_equal(shared, per_layer)


def test_a_float_model_keeps_its_immediates():
    mod = _imported(synthetic.bert_encoder_model(layers=2, hidden=64, heads=4, seq=16))
    assert scalar_operands_bound(mod).same_as(mod)


def test_kernels_built_once_legalize_as_tvm_does(encoders):
    # The QDQ encoder as legalization gets it: quantizes, dequantizes and arithmetic by the hundred, some with
    # constant operands (left to TVM), most alike in attributes and operand types.
    mod = scalar_operands_bound(_through(_imported(encoders[2]), "layout"))
    shared = legalize.custom_legalizations()
    tvms_own = {name: run for name, run in shared.items() if name not in SHARED_ELEMENTWISE}
    with tvm.target.Target(TARGET):
        once = relax.transform.LegalizeOps(shared)(mod)
        each = relax.transform.LegalizeOps(tvms_own)(mod)
    tvm.ir.assert_structural_equal(once, each)
    assert sum(shared[name].reused for name in SHARED_ELEMENTWISE) > 100
