"""Quantized graphs, made by ONNX Runtime's own quantizer: integer arithmetic on activations is found
(static QDQ, QOperator and dynamic quantization); float models and weight-only quantization are not."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_dynamic, quantize_static

from compiler.models.model import load_model
from compiler.models.qoperator import qoperator_as_qdq
from compiler.models.quantized import integer_ops, integer_path_refusal, output_steps
from compiler.models.weights import weight_bytes
from compiler.running.arrays import compare_outputs
from compiler.running.engines import OrtEngine
from compiler.tvm.prepare import split_weights
from tests import convnets, synthetic


class _Images(CalibrationDataReader):
    def __init__(self, shape: tuple[int, ...]) -> None:
        rng = np.random.default_rng(0)
        self._batches = iter([{"x": rng.standard_normal(shape).astype(np.float32)} for _ in range(4)])

    def get_next(self) -> dict | None:
        return next(self._batches, None)


def dynamic_quantized_encoder(directory: Path, *, reduce_range: bool = False) -> bytes:
    """A BERT-style encoder quantized as transformers' are for the CPU (MatMulInteger on int8 weights; 7-bit
    ones with ``reduce_range``, as ONNX Runtime advises for AVX2 CPUs)."""
    source, target = directory / "encoder.onnx", directory / f"encoder_int8_{reduce_range}.onnx"
    source.write_bytes(synthetic.bert_encoder_model(layers=1, hidden=64, heads=4, seq=16))
    quantize_dynamic(str(source), str(target), weight_type=QuantType.QInt8, reduce_range=reduce_range)
    return target.read_bytes()


def static_quantized_encoder(directory: Path, *, layers: int = 1) -> bytes:
    """The encoder quantized statically in QDQ (``quantize_static``): every MatMul between dequantized int8
    operands, its projections' weights int8 constants with a scale per column; each layer's scales its own."""
    source, target = directory / f"encoder_{layers}.onnx", directory / f"encoder_{layers}_qdq.onnx"
    source.write_bytes(synthetic.bert_encoder_model(layers=layers, hidden=64, heads=4, seq=16))
    quantize_static(str(source), str(target), _Images((1, 16, 64)), quant_format=QuantFormat.QDQ, per_channel=True)
    return target.read_bytes()


def static_quantized_convnet(directory: Path, quant_format: QuantFormat) -> bytes:
    source, target = directory / "convnet.onnx", directory / f"convnet_{quant_format.name}.onnx"
    source.write_bytes(convnets.residual_model())
    quantize_static(str(source), str(target), _Images((1, 3, 56, 56)), quant_format=quant_format)
    return target.read_bytes()


def test_dynamic_quantization_is_integer_arithmetic(tmp_path):
    ops = load_model(dynamic_quantized_encoder(tmp_path), max_bytes=1 << 26).integer_ops
    assert "MatMulInteger" in ops and "DynamicQuantizeLinear" in ops, ops


@pytest.mark.parametrize(
    ("quant_format", "expected"), [(QuantFormat.QDQ, "QuantizeLinear"), (QuantFormat.QOperator, "QLinearConv")]
)
def test_static_quantization_is_integer_arithmetic(tmp_path, quant_format, expected):
    assert expected in load_model(static_quantized_convnet(tmp_path, quant_format), max_bytes=1 << 26).integer_ops


def test_float_models_and_weight_only_quantization_are_not():
    assert load_model(convnets.residual_model(), max_bytes=1 << 26).integer_ops == ()
    # int8 weights dequantized to float before a float MatMul: weight work, computed once.
    weight = numpy_helper.from_array(np.arange(-32, 32, dtype=np.int8).reshape(8, 8), "w_int8")
    scale = numpy_helper.from_array(np.array(0.05, np.float32), "w_scale")
    graph = helper.make_graph(
        [helper.make_node("DequantizeLinear", ["w_int8", "w_scale"], ["w"]),
         helper.make_node("MatMul", ["x", "w"], ["y"])],
        "weight_only", [synthetic.value("x", "float32", ["N", 8])], [synthetic.value("y", "float32", ["N", 8])],
        [weight, scale],
    )  # fmt: skip
    assert integer_ops(synthetic.make_model(graph)) == []
    # ... while the same DequantizeLinear of an activation quantized in the graph is integer arithmetic.
    requantized = onnx.ModelProto.FromString(synthetic.make_model(graph).SerializeToString())
    zero = numpy_helper.from_array(np.array(0, np.int8), "x_zero")
    requantized.graph.initializer.append(zero)
    requantized.graph.node.insert(0, helper.make_node("QuantizeLinear", ["x", "w_scale", "x_zero"], ["x_int8"]))
    assert integer_ops(requantized) == ["QuantizeLinear"]


def test_a_dequantized_output_has_its_quantization_step_and_a_float_one_none(tmp_path):
    qdq = onnx.load_from_string(static_quantized_convnet(tmp_path, QuantFormat.QDQ))
    scales = {t.name: numpy_helper.to_array(t) for t in qdq.graph.initializer}
    dequantize = next(n for n in qdq.graph.node if n.op_type == "DequantizeLinear" and n.output[0] == "y")
    assert output_steps(qdq) == {"y": pytest.approx(float(scales[dequantize.input[1]]))}
    # The dynamically quantized encoder computes in float after its last MatMulInteger (a LayerNorm ends it).
    assert output_steps(onnx.load_from_string(dynamic_quantized_encoder(tmp_path))) == {}
    assert output_steps(onnx.load_from_string(convnets.residual_model())) == {}


def test_within_one_quantization_step_on_all_but_a_thousandth_of_elements():
    rng = np.random.default_rng(0)
    want = {"y": rng.standard_normal(10_000).astype(np.float32)}
    step = 0.01

    def off(count: int, steps: float) -> dict[str, np.ndarray]:
        got = want["y"].copy()
        got[:count] += steps * step
        return {"y": got}

    exact = compare_outputs(off(10_000, 1.0), want, 1e-3, 1e-4)
    assert not exact.matches  # fp32's tolerance: one step everywhere is a wrong answer
    everywhere = compare_outputs(off(10_000, 1.0), want, 1e-3, 1e-4, steps={"y": step})
    assert everywhere.matches and "on 100.00% of elements" in everywhere.detail
    assert compare_outputs(off(10, 2.0), want, 1e-3, 1e-4, steps={"y": step}).matches  # 0.1% may stray further
    beyond = compare_outputs(off(11, 2.0), want, 1e-3, 1e-4, steps={"y": step})
    assert not beyond.matches and "on 99.89% of elements" in beyond.detail
    nan = off(0, 0.0)
    nan["y"][0] = np.nan
    assert not compare_outputs(nan, want, 1e-3, 1e-4, steps={"y": step}).matches


@pytest.mark.parametrize("reduce_range", [False, True])
def test_a_dynamically_quantized_encoder_is_kept_in_integers_by_the_compiled_tier(tmp_path, reduce_range):
    """Every integer op of it is one the compiled tier keeps in integers, 7-bit weights or 8-bit."""
    model = load_model(dynamic_quantized_encoder(tmp_path, reduce_range=reduce_range), max_bytes=1 << 26)
    assert model.integer_ops == ("DynamicQuantizeLinear", "MatMulInteger")
    assert model.integer_refusal is None


def test_a_statically_quantized_encoder_is_kept_in_integers(tmp_path):
    """Its projections by int8 weights (compiler/tvm/integer_matmul.py); its attention's matmuls of two
    activations run in float, as the graph spells them."""
    model = load_model(static_quantized_encoder(tmp_path), max_bytes=1 << 26)
    assert model.integer_ops == ("QuantizeLinear",) and model.integer_refusal is None


@pytest.mark.parametrize("quant_format", [QuantFormat.QDQ, QuantFormat.QOperator])
def test_a_statically_quantized_convnet_is_kept_in_integers(tmp_path, quant_format):
    """Its convs of 16 and 64 channels (compiler/tvm/integer_conv.py); a QOperator one in its QDQ spelling."""
    assert load_model(static_quantized_convnet(tmp_path, quant_format), max_bytes=1 << 26).integer_refusal is None


def test_a_qoperator_graph_spelled_as_qdq_answers_as_it_does(tmp_path):
    """QLinearConv, QLinearAdd, QLinearGlobalAveragePool and QGemm as dequantize, float op, quantize: ONNX
    Runtime (which fuses them back) answers the two alike, to the bit."""
    qoperator = onnx.load_from_string(static_quantized_convnet(tmp_path, QuantFormat.QOperator))
    qdq = qoperator_as_qdq(qoperator)
    onnx.checker.check_model(qdq)
    assert integer_ops(qdq) == ["QuantizeLinear"]
    x = {"x": np.random.default_rng(5).standard_normal((2, 3, 56, 56)).astype(np.float32)}
    want = OrtEngine(qoperator.SerializeToString()).run(x)["y"]
    np.testing.assert_array_equal(OrtEngine(qdq.SerializeToString()).run(x)["y"], want)


def test_a_qoperator_op_with_no_qdq_spelling_is_refused_by_name(tmp_path):
    model = onnx.load_from_string(static_quantized_convnet(tmp_path, QuantFormat.QOperator))
    pool = next(n for n in model.graph.node if n.op_type == "QLinearGlobalAveragePool")
    next(a for a in pool.attribute if a.name == "channels_last").i = 1  # NHWC: not spelled here
    assert qoperator_as_qdq(model) is None
    refusal = integer_path_refusal(model)
    assert refusal is not None and "QLinearConv" in refusal and "computed in integers only by ONNX Runtime" in refusal


def test_a_qdq_graph_with_no_conv_in_whole_channel_blocks_says_so(tmp_path):
    """Channels of 12: no conv the integer path takes, so the compiled tier would run it all in float."""
    source, target = tmp_path / "narrow.onnx", tmp_path / "narrow_qdq.onnx"
    source.write_bytes(convnets.residual_model(width=12))
    quantize_static(str(source), str(target), _Images((1, 3, 56, 56)), quant_format=QuantFormat.QDQ)
    refusal = load_model(target.read_bytes(), max_bytes=1 << 26).integer_refusal
    assert refusal is not None and "no conv or matmul of this QDQ graph is computed in integers" in refusal


def test_the_bench_names_each_engines_arithmetic(tmp_path):
    from compiler.building.matrix_units import host_matrix_units
    from compiler.measuring.bench import precisions

    unit = host_matrix_units().unit("int8")
    tvm = f"int8 ({unit})" if unit else "fp32 (its integer ops run in float)"  # a CPU with no int8 unit
    dynamic = load_model(dynamic_quantized_encoder(tmp_path), max_bytes=1 << 26)
    assert precisions(dynamic, "llvm") == {"onnxruntime": "int8", "tvm": tvm, "openvino": "int8"}
    qdq = load_model(static_quantized_convnet(tmp_path, QuantFormat.QDQ), max_bytes=1 << 26)
    assert precisions(qdq, "llvm")["tvm"] == tvm
    qoperator = load_model(static_quantized_convnet(tmp_path, QuantFormat.QOperator), max_bytes=1 << 26)
    assert precisions(qoperator, "llvm")["tvm"] == tvm
    assert set(precisions(load_model(convnets.residual_model(), max_bytes=1 << 26), "llvm").values()) == {"fp32"}


@pytest.mark.parametrize("quantized", [static_quantized_encoder, dynamic_quantized_encoder])
def test_a_quantized_model_weighs_its_int8_weights_as_they_are_held(tmp_path, quantized):
    # Memory admission weighs a model by these bytes: the int8 weights are held (split off and mapped) as
    # the float ones are, and most of a quantized model's bytes are theirs.
    model = onnx.load_from_string(quantized(tmp_path))
    _graph, weights = split_weights(model)
    held = sum(array.nbytes for array in weights.values())
    int8 = sum(array.nbytes for array in weights.values() if array.dtype in (np.int8, np.uint8))
    assert int8 > held / 2
    assert weight_bytes(model) == held
