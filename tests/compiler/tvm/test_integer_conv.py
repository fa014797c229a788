"""Statically quantized convs kept in integers (compiler/tvm/integer_conv.py, schedules/integer.py): a QDQ
``Conv`` of a quantized activation by an int8 weight compiles to an int16 conv tensorized into
``vpmaddwd``, whose sums are the exact integer ones, at the extremes of the activation's range."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from compiler.building.matrix_units import host_matrix_units
from compiler.tvm.build import compile_relax, import_relax
from compiler.tvm.integer_conv import pack_conv_panels, quantized_convs
from tests.compiler.tvm.kernels import compiled_with_weight_parameters, instruction_lines, scheduled_kernel

TARGET = {"kind": "llvm", "mcpu": "haswell", "num-cores": 2}
pytestmark = pytest.mark.skipif(not host_matrix_units().has("avx2"), reason="the int8 kernels here need AVX2")

X_SCALE = 0.05


def _qdq_conv(
    shape, weight, w_scale, bias, x_zero, *, stride: int, pad: int, x_scale: float = X_SCALE
) -> onnx.ModelProto:
    """``y = Conv(DQ(Q(x)), DQ(W), bias)``: the QDQ form ``quantize_static`` writes, weights per channel."""
    zero_type = TensorProto.UINT8 if x_zero.dtype == np.uint8 else TensorProto.INT8
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "x_scale", "x_zero"], ["xd"]),
        helper.make_node("DequantizeLinear", ["w", "w_scale", "w_zero"], ["wd"], axis=0),
        helper.make_node("Conv", ["xd", "wd", "b"], ["y"], kernel_shape=list(weight.shape[2:]),
                         pads=[pad] * 4, strides=[stride] * 2),
    ]  # fmt: skip
    initializers = [
        helper.make_tensor("x_scale", TensorProto.FLOAT, [], [x_scale]),
        helper.make_tensor("x_zero", zero_type, [], [int(x_zero)]),
        numpy_helper.from_array(weight, "w"),
        numpy_helper.from_array(w_scale, "w_scale"),
        numpy_helper.from_array(np.zeros(weight.shape[0], np.int8), "w_zero"),
        numpy_helper.from_array(bias, "b"),
    ]
    graph = helper.make_graph(nodes, "qdq_conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializers)  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _operands(shape, out_channels: int, kernel: int, activation: str, bits: int = 8):
    """8-bit weights over int8's range; 7-bit ones (-64..64: every pair of channels keeps vpmaddubsw's bound)."""
    rng = np.random.default_rng(5)
    x = rng.normal(0, 3, shape).astype(np.float32)
    x[0, :, 0, 0], x[0, :, 0, 1] = 1e3, -1e3  # clipped to the type's ends
    low, high = (-128, 127) if bits == 8 else (-64, 64)
    weight = rng.integers(low, high + 1, (out_channels, shape[1], kernel, kernel)).astype(np.int8)
    weight[0] = low  # with the activation's extremes: the largest sums of products
    w_scale = rng.uniform(0.001, 0.01, out_channels).astype(np.float32)
    bias = rng.normal(0, 1, out_channels).astype(np.float32)
    x_zero = np.array(7 if activation == "int8" else 131, activation)
    return x, weight, w_scale, bias, x_zero


def _reference(x, weight, w_scale, bias, x_zero, *, stride: int, pad: int, x_scale: float = X_SCALE) -> np.ndarray:
    """The conv of the quantized activation (rounded half to even, as ONNX says), in exact integers, scaled
    in float64."""
    limits = np.iinfo(x_zero.dtype)
    quantized = np.clip(np.round(x / np.float32(x_scale)) + int(x_zero), limits.min, limits.max).astype(np.int64)
    centred = np.pad(quantized - int(x_zero), [(0, 0), (0, 0), (pad, pad), (pad, pad)])
    kernel = weight.shape[2]
    out_h, out_w = ((d - kernel) // stride + 1 for d in centred.shape[2:])
    sums = np.zeros((x.shape[0], weight.shape[0], out_h, out_w), np.int64)
    for i in range(kernel):
        for j in range(kernel):
            window = centred[:, :, i : i + stride * out_h : stride, j : j + stride * out_w : stride]
            sums += np.einsum("nchw,oc->nohw", window, weight[:, :, i, j].astype(np.int64))
    scale = np.float64(x_scale) * w_scale.astype(np.float64)
    return sums * scale[None, :, None, None] + bias[None, :, None, None]


# 8-bit weights in int16 pairs (vpmaddwd); 7-bit ones in bytes (vpmaddubsw), the activation shifted to
# uint8 and padded with its zero point, which the taps' sums take back out. A weight held as a parameter,
# as the server compiles it, is packed by the weight transform and answers as a constant one does.
@pytest.mark.parametrize(("activation", "geometry", "bits", "held"), [
    ("int8", ((1, 16, 9, 10), 1, 1), 8, "constant"),
    ("uint8", ((2, 8, 11, 11), 2, 1), 8, "constant"),
    ("int8", ((1, 16, 7, 7), 1, 0), 8, "constant"),
    ("int8", ((1, 16, 9, 10), 1, 1), 7, "constant"),
    ("uint8", ((2, 8, 11, 11), 2, 1), 7, "constant"),
    ("int8", ((1, 16, 9, 10), 1, 1), 8, "parameter"),
    ("uint8", ((2, 8, 11, 11), 2, 1), 7, "parameter"),
])  # fmt: skip
def test_a_qdq_conv_sums_exactly_in_integers(activation, geometry, bits, held, tmp_path):
    shape, stride, pad = geometry
    kernel = 3 if pad else 1
    x, weight, w_scale, bias, x_zero = _operands(shape, 16, kernel, activation, bits)
    model = _qdq_conv(shape, weight, w_scale, bias, x_zero, stride=stride, pad=pad)
    if held == "constant":
        observed: dict = {}
        executable = compile_relax(import_relax(model, {"x": shape}, {"x": "float32"}), TARGET, observed=observed)
        got = relax.VirtualMachine(executable, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    else:
        engine, observed, library, weights = compiled_with_weight_parameters(
            model, {"x": shape}, {"x": "float32"}, TARGET, tmp_path
        )
        assert weights["w"].dtype == np.int8 and weights["w"].tobytes()[:64] not in library
        got = engine.run({"x": x})["y"]
    assert "IntegerConvContraction" in observed["schedules"].values()
    instruction = "vpmaddwd" if bits == 8 else "vpmaddubsw"
    assert set(observed["units"].values()) == {f"int8 on avx2 ({instruction})"}
    want = _reference(x, weight, w_scale, bias, x_zero, stride=stride, pad=pad)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_quantize_rounds_ties_to_even_as_onnx_does():
    """A scale of 1/4: activations of k + 1/2 steps exactly, which rounding half away from zero would put one
    step off (TVM's ``round`` is LLVM's ``nearbyint`` on the CPU: ties to even)."""
    shape = (1, 16, 6, 6)
    _, weight, w_scale, bias, x_zero = _operands(shape, 16, 3, "int8")
    ties = (np.arange(np.prod(shape)) % 9 - 4 + 0.5).astype(np.float32).reshape(shape) * np.float32(0.25)
    model = _qdq_conv(shape, weight, w_scale, bias, x_zero, stride=1, pad=1, x_scale=0.25)
    executable = compile_relax(import_relax(model, {"x": shape}, {"x": "float32"}), TARGET)
    got = relax.VirtualMachine(executable, tvm.cpu())["main"](tvm.runtime.tensor(ties)).numpy()
    want = _reference(ties, weight, w_scale, bias, x_zero, stride=1, pad=1, x_scale=0.25)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize(("channels", "rewritten"), [(16, 1), (12, 0)])
def test_only_convs_of_whole_channel_blocks_are_rewritten(channels, rewritten):
    shape = (1, channels, 6, 6)
    _, weight, w_scale, bias, x_zero = _operands(shape, channels, 3, "int8")
    mod = import_relax(_qdq_conv(shape, weight, w_scale, bias, x_zero, stride=1, pad=1), {"x": shape},
                       {"x": "float32"})  # fmt: skip
    assert quantized_convs(mod, 8)[1] == rewritten


def test_conv_panels_hold_pairs_of_input_channels_under_each_output_channel():
    exact = np.arange(16 * 16 * 2 * 3, dtype=np.int16).reshape(16, 16, 2, 3)
    panels = pack_conv_panels(exact, 8)
    assert panels.shape == (2, 2, 2, 3, 4, 8, 2)
    out_block, in_block, row, column, pair, lane, within = 1, 0, 1, 2, 3, 5, 1
    assert panels[out_block, in_block, row, column, pair, lane, within] == exact[8 + 5, 7, 1, 2]


# 8-bit weights: int16 pairs on AVX2, bytes on VNNI (vpdpbusd sums them into int32 exactly).
@pytest.mark.parametrize(("mcpu", "instruction", "register"), [
    ("haswell", "vpmaddwd", "%ymm"),
    ("alderlake", "vpdpbusd", "%ymm"),  # AVX-VNNI
    ("cascadelake", "vpdpbusd", "%zmm"),  # AVX512-VNNI on AVX-512's 16-channel blocks
])  # fmt: skip
def test_the_integer_conv_runs_on_the_targets_int8_unit(mcpu, instruction, register):
    """Checked by the code compiled for each CPU (run above where this one is one)."""
    from compiler.tvm.schedules import IntegerConvContraction

    shape = (1, 32, 7, 7)
    _, weight, w_scale, bias, x_zero = _operands(shape, 32, 3, "int8")
    mod = import_relax(_qdq_conv(shape, weight, w_scale, bias, x_zero, stride=1, pad=1), {"x": shape},
                       {"x": "float32"})  # fmt: skip
    target = tvm.target.Target({**TARGET, "mcpu": mcpu})
    _, asm = scheduled_kernel(mod, target, "integer_conv", IntegerConvContraction)
    products = instruction_lines(asm, instruction)
    assert products and all(register in line for line in products)


@pytest.mark.parametrize("axis_values", [1, 6])
def test_a_constant_dequantize_is_computed_as_the_legalized_op_computes_it(axis_values):
    """A QDQ graph's int32 bias (per tensor, or per channel) is dequantized at compile time in numpy, equal to
    the bit to what TVM's legalization and FoldConstant make of it, one kernel apiece."""
    from compiler.tvm.integer_conv import dequantized_constant

    rng = np.random.default_rng(4)
    data = relax.const(rng.integers(-(2**30), 2**30, (2, 6)).astype(np.int32))
    scale = relax.const(rng.uniform(1e-6, 1e-2, axis_values).astype(np.float32).reshape(-1 if axis_values > 1 else ()))
    zero = relax.const(np.zeros(axis_values, np.int32).reshape(-1 if axis_values > 1 else ()))
    call = relax.op.dequantize(data, scale, zero, axis=1)
    folded = dequantized_constant(call)
    assert isinstance(folded, tvm.ir.GenericConst)
    builder = relax.BlockBuilder()
    with builder.function("main", []):
        builder.emit_func_output(builder.emit(call))
    with tvm.target.Target(TARGET):
        legalized = relax.transform.FoldConstant()(relax.transform.LegalizeOps()(builder.get()))
    want = legalized["main"].body.body
    want = want if isinstance(want, tvm.ir.GenericConst) else legalized["main"].body.blocks[-1].bindings[-1].value
    np.testing.assert_array_equal(folded.value.numpy(), want.value.numpy())


@pytest.mark.parametrize(
    ("width", "blocks", "accumulators", "tile"),
    [
        (56, 4, 8, (4, 2)),  # AVX2: the first that fits its 16 registers
        (14, 4, 8, (7, 1)),
        (56, 4, 16, (4, 4)),  # AVX-512: the most accumulators its 32 registers hold
        (14, 4, 16, (7, 2)),
        (7, 32, 16, (7, 2)),
        (13, 1, 16, (1, 1)),
    ],
)
def test_the_conv_register_tile_fills_the_registers_the_unit_has(width, blocks, accumulators, tile):
    from compiler.tvm.schedules.integer import _conv_tile

    assert _conv_tile(width, blocks, 1, accumulators) == tile
