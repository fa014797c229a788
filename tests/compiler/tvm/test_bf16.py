"""bf16 matmuls (compiler/tvm/bf16.py): under a bf16 compile, a matmul by a weight reads bf16 panels
packed once in the weight transform and a bf16 activation, and sums the products in float32, as numpy
does with the same roundings; on a CPU with AVX512-BF16 the product is ``vdpbf16ps``, checked by the code
compiled for one (this CPU runs the same sums on its FMA units)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper

from compiler.running.engines import TvmEngine
from compiler.tvm.bf16 import PRECISION_ATTR, bf16_matmuls
from compiler.tvm.build import compile_relax, import_relax
from compiler.tvm.pipeline import tuned_module_stages
from compiler.tvm.schedules import IntegerContraction, IntegerConvContraction
from tests.compiler.tvm.kernels import instruction_lines, scheduled_kernel

HOST = {"kind": "llvm", "mcpu": "haswell", "num-cores": 2}


def _linear(rows: int, depth: int, columns: int) -> tuple[onnx.ModelProto, np.ndarray, np.ndarray]:
    """``y = relu(x @ W + b)``, the weight and bias as inputs after ``x``: parameters, as a compile's weights
    are (``compiler/tvm/prepare.py`` takes them out of the graph)."""
    rng = np.random.default_rng(11)
    weight = rng.standard_normal((depth, columns)).astype(np.float32)
    bias = rng.standard_normal(columns).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["z"]),
         helper.make_node("Relu", ["z"], ["y"])],
        "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, depth]),
                   helper.make_tensor_value_info("w", TensorProto.FLOAT, [depth, columns]),
                   helper.make_tensor_value_info("b", TensorProto.FLOAT, [columns])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, columns])],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), weight, bias


def _imported(model: onnx.ModelProto, rows: int, depth: int) -> tvm.IRModule:
    return import_relax(model, {"x": (rows, depth)}, {"x": "float32"})


def bf16_rounded(values: np.ndarray) -> np.ndarray:
    """float32 ``values`` rounded to bf16 (nearest, ties to even), as float32."""
    bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + ((bits >> 16) & 1) + 0x7FFF) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32)


def test_bf16_rounding_is_to_nearest_even():
    ties = np.array([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-9, -(1 + 2**-8)], np.float32)
    assert bf16_rounded(ties).tolist() == [1.0, 1 + 2**-6, 1.0, -1.0]


def test_a_bf16_compile_computes_with_bf16_operands_and_float32_sums(tmp_path):
    rows, depth, columns = 5, 38, 40  # columns past one 16-lane panel, not a whole number of them
    model, weight, bias = _linear(rows, depth, columns)
    executable = compile_relax(_imported(model, rows, depth), HOST, precision="bf16")
    executable.export_library(str(tmp_path / "linear.so"))
    # As the server runs it: the weight transform (the bf16 panels) once, then main.
    engine = TvmEngine(tmp_path / "linear.so", ["x"], ["y"], weights=[tvm.runtime.tensor(a) for a in (weight, bias)])
    x = np.random.default_rng(12).standard_normal((rows, depth)).astype(np.float32)
    x[0, :2] = [np.float32(1 + 2**-8), np.float32(1 + 3 * 2**-8)]  # ties, rounded to even
    got = engine.run({"x": x})["y"]
    products = bf16_rounded(x).astype(np.float64) @ bf16_rounded(weight).astype(np.float64)
    want = np.maximum(products + bias, 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    exact = np.maximum(x.astype(np.float64) @ weight + bias, 0)
    assert np.abs(got - exact).max() > 1e-3  # bf16 operands, not float32 ones


def test_only_a_bf16_compile_rewrites_and_the_panels_are_weight_work():
    model, *_ = _linear(4, 32, 16)
    mod = _imported(model, 4, 32)
    assert bf16_matmuls(mod)[1] == 1
    odd, *_ = _linear(4, 33, 16)  # bf16 pairs of k
    assert bf16_matmuls(_imported(odd, 4, 33))[1] == 0
    target = tvm.target.Target(HOST)
    for precision, panels_lifted in (("fp32", False), ("bf16", True)):
        staged = mod.with_attr(PRECISION_ATTR, precision)
        with target:
            for name, passes in tuned_module_stages(target):
                staged = tvm.transform.Sequential(passes)(staged)
                if name == "layout":
                    break
        transforms = [f for gv, f in staged.functions_items() if gv.name_hint.startswith("main_transform_params")]
        assert any("bf16_panels" in f.script() for f in transforms) == panels_lifted, precision


@pytest.mark.parametrize("mcpu", ["cooperlake", "sapphirerapids"])
def test_the_bf16_product_is_vdpbf16ps_where_the_cpu_has_avx512_bf16(mcpu):
    model, *_ = _linear(8, 64, 32)
    target = tvm.target.Target({**HOST, "mcpu": mcpu})
    mod = _imported(model, 8, 64).with_attr(PRECISION_ATTR, "bf16")
    sch, asm = scheduled_kernel(mod, target, "bf16_matmul", IntegerContraction)
    assert sch is not None
    unit = sch.mod["main"].body.block.annotations["jitserve_unit"]
    assert str(unit) == "bf16 on avx512-bf16 (vdpbf16ps)"
    assert instruction_lines(asm, "vdpbf16ps")


def test_a_bf16_product_of_rows_with_no_tile_divisor_is_tiled_on_rows_padded_to_one():
    """ViT's 197 tokens (a prime): the activation is zero-padded to 200 rows and the product tiled 4 rows at
    a time, the output cut back to 197 (one-row tiles read every weight panel once per row). The rows=5
    compile above checks the padded product's answers."""
    model, *_ = _linear(197, 64, 32)
    target = tvm.target.Target({**HOST, "mcpu": "cooperlake"})
    sch, _ = scheduled_kernel(_imported(model, 197, 64).with_attr(PRECISION_ATTR, "bf16"), target, "bf16_matmul",
                              IntegerContraction)  # fmt: skip
    script = sch.mod["main"].script()
    assert 'T.Buffer((T.int64(200), T.int64(64)), "uint16")' in script  # the bf16 activation, padded
    assert 'T.Buffer((T.int64(197), T.int64(32)), "float32")' in script  # the output, cut back
    assert "T.unroll(T.int64(4))" in script


def test_a_bf16_compile_is_an_artifact_of_its_own():
    from compiler.building.options import CompileOptions

    fp32, bf16 = CompileOptions(), CompileOptions(precision="bf16")
    assert "precision" not in fp32.key_options() and bf16.key_options()["precision"] == "bf16"


def _conv(shape, out_channels: int) -> onnx.ModelProto:
    """``y = relu(conv3x3(x, W, b))``, padded by 1, the weight and bias as parameters."""
    channels = shape[1]
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["z"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["z"], ["y"])],
        "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape)),
                 helper.make_tensor_value_info("w", TensorProto.FLOAT, [out_channels, channels, 3, 3]),
                 helper.make_tensor_value_info("b", TensorProto.FLOAT, [out_channels])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_a_bf16_compile_computes_a_blocked_conv_with_bf16_operands(tmp_path):
    shape, out_channels = (1, 16, 9, 10), 16
    rng = np.random.default_rng(13)
    x = rng.standard_normal(shape).astype(np.float32)
    weight = rng.standard_normal((out_channels, shape[1], 3, 3)).astype(np.float32)
    bias = rng.standard_normal(out_channels).astype(np.float32)
    observed: dict = {}
    mod = import_relax(_conv(shape, out_channels), {"x": shape}, {"x": "float32"})
    executable = compile_relax(mod, HOST, observed=observed, precision="bf16")
    assert any(name.startswith("fused_bf16_conv") for name in observed["schedules"])
    executable.export_library(str(tmp_path / "conv.so"))
    engine = TvmEngine(tmp_path / "conv.so", ["x"], ["y"], weights=[tvm.runtime.tensor(a) for a in (weight, bias)])
    got = engine.run({"x": x})["y"]

    def conv(data: np.ndarray, kernel: np.ndarray) -> np.ndarray:
        padded = np.pad(data.astype(np.float64), [(0, 0), (0, 0), (1, 1), (1, 1)])
        sums = sum(np.einsum("nchw,oc->nohw", padded[:, :, i : i + 9, j : j + 10], kernel[:, :, i, j])
                   for i in range(3) for j in range(3))  # fmt: skip
        return np.maximum(sums + bias[None, :, None, None], 0)

    np.testing.assert_allclose(got, conv(bf16_rounded(x), bf16_rounded(weight)), rtol=1e-5, atol=1e-4)
    assert np.abs(got - conv(x, weight)).max() > 1e-3  # bf16 operands, not float32 ones


def test_the_bf16_conv_is_vdpbf16ps_on_avx512_blocks():
    target = tvm.target.Target({**HOST, "mcpu": "cooperlake"})
    mod = import_relax(_conv((1, 32, 7, 7), 32), {"x": (1, 32, 7, 7)}, {"x": "float32"}).with_attr(
        PRECISION_ATTR, "bf16"
    )
    _, asm = scheduled_kernel(mod, target, "bf16_conv", IntegerConvContraction)
    products = instruction_lines(asm, "vdpbf16ps")
    assert products and all("%zmm" in line for line in products)
