"""Quantized matmuls kept in integers (compiler/tvm/integer_matmul.py, schedules/integer.py): an ONNX
``MatMulInteger`` by an int8 weight (a constant, or a parameter as the server compiles it) compiles to
int16 panels tensorized into ``vpmaddwd``, or, for 7-bit weights, int8 panels into ``vpmaddubsw``; either
answers exactly as the spec's int32 arithmetic does, at the extremes of its operands."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from compiler.building.matrix_units import host_matrix_units
from compiler.building.target import resolve_target
from compiler.models.quantized import byte_pairs_fit
from compiler.running.engines import OrtEngine
from compiler.tvm.build import compile_relax, import_relax
from compiler.tvm.integer_matmul import integer_matmuls
from compiler.tvm.schedules import IntegerContraction
from tests.compiler.tvm.kernels import compiled_with_weight_parameters, instruction_lines, scheduled_kernel

TARGET = {"kind": "llvm", "mcpu": "haswell", "num-cores": 2}
DOTTED = "encoder.layer.0.w"
pytestmark = pytest.mark.skipif(not host_matrix_units().has("avx2"), reason="the int8 kernels here need AVX2")


def _matmul_integer(
    rows: int, depth: int, columns: int, weight: np.ndarray, weight_zero: np.ndarray, *, batch: int = 1
) -> bytes:
    """``y = MatMulInteger(a, W, a_zero, W_zero)``: ``a`` uint8 and its zero point inputs, ``W`` int8 with a
    zero point per column."""
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "w", "a_zero", "w_zero"], ["y"])],
        "matmul_integer",
        [
            helper.make_tensor_value_info("a", TensorProto.UINT8, [batch, rows, depth]),
            helper.make_tensor_value_info("a_zero", TensorProto.UINT8, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [batch, rows, columns])],
        [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(weight_zero, "w_zero")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]).SerializeToString()


def _extreme_operands(rows: int, depth: int, columns: int, bits: int = 8, batch: int = 1):
    """8 bits: weights and zero points over int8's range, whose pair sums with 255 overflow int16 twice over.
    7 bits (``reduce_range``): weights of -64..64 and no zero point, the first two columns' pairs summing
    to -128 and 128, vpmaddubsw's bound."""
    rng = np.random.default_rng(3)
    a = rng.integers(0, 256, (batch, rows, depth)).astype(np.uint8)
    low, high = (-128, 127) if bits == 8 else (-64, 64)
    w = rng.integers(low, high + 1, (depth, columns)).astype(np.int8)
    a[0, 0], w[:, 0] = 255, low
    a[0, 1], w[:, 1] = 0, high
    w_zero = rng.integers(-128, 128, columns).astype(np.int8) if bits == 8 else np.zeros(columns, np.int8)
    w_zero[0] = 127 if bits == 8 else 0
    return a, w, w_zero


def _compiled(model: bytes, rows: int, depth: int, batch: int = 1, target: dict = TARGET):
    bucket = {"a": (batch, rows, depth), "a_zero": ()}
    mod = import_relax(onnx.load_from_string(model), bucket, {"a": "uint8", "a_zero": "uint8"})
    observed: dict = {}
    executable = compile_relax(mod, target, observed=observed)
    return relax.VirtualMachine(executable, tvm.cpu()), observed


def _answers(model: onnx.ModelProto, bucket: dict, dtypes: dict, held: str, directory: Path):
    """``model`` compiled with its int8 weight as a constant or, as the server compiles it, as a parameter
    (then asserted to be out of the kernel): a function of the inputs to the first output, and what the
    compile observed."""
    if held == "constant":
        observed: dict = {}
        executable = compile_relax(import_relax(model, bucket, dtypes), TARGET, observed=observed)
        vm = relax.VirtualMachine(executable, tvm.cpu())
        return lambda *inputs: vm["main"](*(tvm.runtime.tensor(value) for value in inputs)).numpy(), observed
    # Named as exporters name weights: the importer renames a name with a dot, and the compile finds it so.
    for tensor in model.graph.initializer:
        tensor.name = DOTTED if tensor.name == "w" else tensor.name
    for node in model.graph.node:
        node.input[:] = [DOTTED if name == "w" else name for name in node.input]
    engine, observed, library, weights = compiled_with_weight_parameters(model, bucket, dtypes, TARGET, directory)
    assert weights[DOTTED].dtype.kind in "iu" and weights[DOTTED].tobytes()[:64] not in library
    return lambda *inputs: next(iter(engine.run(dict(zip(bucket, inputs, strict=True))).values())), observed


# A batch of 3: its rows are not flattened into one matmul before the rewrite finds the widened operands
# (BERT-base at 8x128 ran the int32 matmul, 2.3x ONNX Runtime). A weight held as a parameter (packed by
# the weight transform) answers as a constant one does.
@pytest.mark.parametrize(("bits", "sizes", "held"), [
    (8, (1, 5, 34, 20), "constant"),
    (7, (3, 5, 36, 20), "constant"),
    (8, (1, 5, 34, 20), "parameter"),
    (7, (3, 5, 36, 20), "parameter"),
])  # fmt: skip
def test_a_matmul_integer_is_computed_exactly_on_its_panels(bits, sizes, held, tmp_path):
    batch, rows, depth, columns = sizes
    a, w, w_zero = _extreme_operands(rows, depth, columns, bits, batch)
    model = onnx.load_from_string(_matmul_integer(rows, depth, columns, w, w_zero, batch=batch))
    bucket = {"a": (batch, rows, depth), "a_zero": ()}
    run, observed = _answers(model, bucket, {"a": "uint8", "a_zero": "uint8"}, held, tmp_path)
    assert "IntegerContraction" in observed["schedules"].values()
    instruction = "vpmaddwd" if bits == 8 else "vpmaddubsw"
    assert set(observed["units"].values()) == {f"int8 on avx2 ({instruction})"}  # what the explain report names
    for a_zero in (0, 131, 255):
        got = run(a, np.array(a_zero, np.uint8))
        want = (a.astype(np.int64) - a_zero) @ (w.astype(np.int64) - w_zero.astype(np.int64))
        np.testing.assert_array_equal(got, want.astype(np.int32))


def test_only_matmuls_by_constant_int8_weights_of_even_depth_are_rewritten():
    for depth, rewritten in ((34, 1), (33, 0)):
        _, w, w_zero = _extreme_operands(4, depth, 16)
        model = onnx.load_from_string(_matmul_integer(4, depth, 16, w, w_zero))
        mod = import_relax(model, {"a": (1, 4, depth), "a_zero": ()}, {"a": "uint8", "a_zero": "uint8"})
        assert integer_matmuls(mod)[1] == rewritten, depth


def test_byte_pairs_fit_vpmaddubsw_exactly_up_to_its_bound():
    column = np.zeros((8, 1), np.int16)
    for pair, fits in (((64, 64), True), ((65, 64), False), ((-64, -64), True), ((-64, -65), False),
                       ((127, -128), True), ((127, 2), False)):  # fmt: skip
        column[2:4, 0] = pair
        assert byte_pairs_fit(column) == fits, pair
    assert not byte_pairs_fit(np.zeros((7, 1), np.int16))  # k in pairs
    assert not byte_pairs_fit(np.full((8, 1), 200, np.int16))  # no int8 (a zero point subtracted)


def test_a_matmul_integer_by_8_bit_weights_answers_as_onnx_runtime_does_to_the_bit():
    """Symmetric 8-bit weights (``quantize_dynamic``'s): byte panels, as ONNX Runtime's own kernels take them.
    On AVX2 both sum byte pairs with ``vpmaddubsw``, saturating at the operands' extremes alike, where the
    spec's int32 arithmetic (and int16 pairs) would not; on VNNI both are exact."""
    a, w, w_zero = _extreme_operands(5, 36, 20)
    w_zero[:] = 0
    model = onnx.load_from_string(_matmul_integer(5, 36, 20, w, w_zero))
    model.ir_version = 8  # the ONNX Runtime here reads IR versions up to 13
    vm, observed = _compiled(model.SerializeToString(), 5, 36, target=resolve_target("llvm"))  # this CPU's unit
    unit = host_matrix_units().unit("int8")
    (label,) = set(observed["units"].values())
    assert label.endswith("(vpmaddubsw)" if unit == "avx2" else "(vpdpbusd)"), label
    reference = OrtEngine(model.SerializeToString())
    for a_zero in (0, 131, 255):
        zero = np.array(a_zero, np.uint8)
        got = vm["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(zero)).numpy()
        want = reference.run({"a": a, "a_zero": zero})["y"]
        np.testing.assert_array_equal(got, want)
        exact = (a.astype(np.int64) - a_zero) @ w.astype(np.int64)
        assert np.array_equal(want, exact) == (unit != "avx2")  # the extremes saturate AVX2's byte pairs


# MatMulInteger takes bytes on any int8 weight: vpmaddubsw on AVX2 (ONNX Runtime's own saturating pairs), and on
# VNNI (Cascade Lake's AVX512-VNNI, Alder Lake's AVX-VNNI) vpdpbusd, which sums bytes into int32 exactly.
# Checked by the code compiled for those CPUs, run where this one is one.
@pytest.mark.parametrize(
    ("mcpu", "bits", "instruction"),
    [("haswell", 8, "vpmaddubsw"), ("haswell", 7, "vpmaddubsw"), ("cascadelake", 8, "vpdpbusd"),
     ("alderlake", 8, "vpdpbusd")],
)  # fmt: skip
def test_a_matmul_integer_takes_bytes_on_the_targets_unit(mcpu, bits, instruction):
    _, w, w_zero = _extreme_operands(8, 64, 48, bits)
    w_zero[:] = 0  # W - zw in int8: byte panels wherever the unit sums them exactly
    bucket = {"a": (1, 8, 64), "a_zero": ()}
    mod = import_relax(onnx.load_from_string(_matmul_integer(8, 64, 48, w, w_zero)), bucket,
                       {"a": "uint8", "a_zero": "uint8"})  # fmt: skip
    target = tvm.target.Target({**TARGET, "mcpu": mcpu})
    _, asm = scheduled_kernel(mod, target, "integer_matmul", IntegerContraction)
    assert instruction_lines(asm, instruction)
    assert bool(instruction_lines(asm, "vpmaddubsw")) == (instruction == "vpmaddubsw")


def _qdq_matmul(shape, weight: np.ndarray, w_scale: np.ndarray, w_zero: np.ndarray, *, x_zero: np.ndarray,
                x_scale: float) -> onnx.ModelProto:  # fmt: skip
    """``y = MatMul(DQ(Q(x)), DQ(W)) + b``: the QDQ form ``quantize_static`` writes for a transformer's
    projections, the weight's scale and zero point per column (axis 1)."""
    zero_type = TensorProto.UINT8 if x_zero.dtype == np.uint8 else TensorProto.INT8
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "x_scale", "x_zero"], ["xd"]),
        helper.make_node("DequantizeLinear", ["w", "w_scale", "w_zero"], ["wd"], axis=1),
        helper.make_node("MatMul", ["xd", "wd"], ["xw"]),
        helper.make_node("Add", ["xw", "b"], ["y"]),
    ]
    initializers = [
        helper.make_tensor("x_scale", TensorProto.FLOAT, [], [x_scale]),
        helper.make_tensor("x_zero", zero_type, [], [int(x_zero)]),
        numpy_helper.from_array(weight, "w"),
        numpy_helper.from_array(w_scale, "w_scale"),
        numpy_helper.from_array(w_zero, "w_zero"),
        numpy_helper.from_array(np.linspace(-1, 1, weight.shape[1]).astype(np.float32), "b"),
    ]
    graph = helper.make_graph(nodes, "qdq_matmul", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializers)  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


# int8 and uint8 activations (an int8 one enters shifted to uint8), int8 and uint8 weights, 8-bit and 7-bit,
# as constants and as parameters.
@pytest.mark.parametrize(("types", "bits", "instruction", "held"), [
    (("int8", "int8"), 8, "vpmaddwd", "constant"),
    (("uint8", "uint8"), 8, "vpmaddwd", "constant"),
    (("int8", "int8"), 7, "vpmaddubsw", "constant"),
    (("uint8", "uint8"), 8, "vpmaddwd", "parameter"),
    (("int8", "int8"), 7, "vpmaddubsw", "parameter"),
])  # fmt: skip
def test_a_qdq_matmul_by_a_weight_sums_exactly_in_integers(types, bits, instruction, held, tmp_path):
    activation, weights = types
    shape, depth, columns, x_scale = (2, 5, 32), 32, 24, 0.05
    rng = np.random.default_rng(9)
    x = rng.normal(0, 3, shape).astype(np.float32)
    x[0, 0], x[0, 1] = 1e3, -1e3  # clipped to the type's ends
    x_zero = np.array(7 if activation == "int8" else 131, activation)
    low, high = (-128, 127) if bits == 8 else (-64, 64)
    centred = rng.integers(low, high + 1, (depth, columns))
    centred[:, 0] = low
    w_zero = (np.full(columns, 128) if weights == "uint8" else np.zeros(columns, int)).astype(weights)
    weight = (centred + w_zero.astype(int)).astype(weights)
    w_scale = rng.uniform(0.001, 0.01, columns).astype(np.float32)
    model = _qdq_matmul(shape, weight, w_scale, w_zero, x_zero=x_zero, x_scale=x_scale)
    run, observed = _answers(model, {"x": shape}, {"x": "float32"}, held, tmp_path)
    assert "IntegerContraction" in observed["schedules"].values()
    assert set(observed["units"].values()) == {f"int8 on avx2 ({instruction})"}
    got = run(x)
    limits = np.iinfo(x_zero.dtype)
    quantized = np.clip(np.round(x / np.float32(x_scale)) + int(x_zero), limits.min, limits.max).astype(np.int64)
    sums = (quantized - int(x_zero)) @ centred.astype(np.int64)
    want = sums * (np.float64(x_scale) * w_scale.astype(np.float64)) + np.linspace(-1, 1, columns)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_only_qdq_matmuls_by_even_deep_weights_are_rewritten():
    from compiler.tvm.integer_matmul import quantized_matmuls

    for depth, rewritten in ((32, 1), (33, 0)):
        weight = np.ones((depth, 8), np.int8)
        model = _qdq_matmul(
            (1, 4, depth),
            weight,
            np.ones(8, np.float32),
            np.zeros(8, np.int8),
            x_zero=np.array(0, np.int8),
            x_scale=0.1,
        )
        mod = import_relax(model, {"x": (1, 4, depth)}, {"x": "float32"})
        assert quantized_matmuls(mod)[1] == rewritten


def test_a_quantized_embedding_is_looked_up_before_it_is_dequantized(tmp_path):
    """``Gather(DequantizeLinear(table), ids)`` answers as ONNX Runtime does, to the bit, and no weight
    transform holds the table in float: the rows are looked up in int8, then dequantized."""
    rng = np.random.default_rng(0)
    table = rng.integers(-128, 128, (300, 16)).astype(np.int8)
    nodes = [
        helper.make_node("DequantizeLinear", ["table", "scale", "zero"], ["dequantized"]),
        helper.make_node("Gather", ["dequantized", "ids"], ["y"]),
    ]
    initializers = [
        numpy_helper.from_array(table, "table"),
        helper.make_tensor("scale", TensorProto.FLOAT, [], [0.02]),
        helper.make_tensor("zero", TensorProto.INT8, [], [3]),
    ]
    graph = helper.make_graph(nodes, "embedding", [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializers)  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    engine, observed, _, _ = compiled_with_weight_parameters(model, {"ids": (2, 5)}, {"ids": "int64"}, TARGET, tmp_path)
    assert sum(output["bytes"] for output in observed.get("weight_outputs") or []) < table.size
    ids = rng.integers(-300, 300, (2, 5)).astype(np.int64)  # negative ids count from the end, as ONNX says
    want = OrtEngine(model.SerializeToString()).run({"ids": ids})["y"]
    np.testing.assert_array_equal(engine.run({"ids": ids})["y"], want)
