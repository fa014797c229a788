"""FLOP counts of the contractions, checked against hand-counted graphs."""

from __future__ import annotations

import numpy as np
from onnx import helper, numpy_helper

from compiler.measuring.flops import model_flops
from tests.synthetic import make_model, value


def test_conv_and_matmul_flops_are_two_per_multiply_add():
    weight = numpy_helper.from_array(np.zeros((16, 4, 3, 3), np.float32), "W")  # groups of 4 input channels
    dense = numpy_helper.from_array(np.zeros((10, 5), np.float32), "D")
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=2),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("Reshape", ["r", "s"], ["m"]),
        helper.make_node("MatMul", ["m", "D"], ["y"]),
    ]
    shape = numpy_helper.from_array(np.array([-1, 10], np.int64), "s")
    graph = helper.make_graph(
        nodes,
        "flops",
        [value("x", "float32", ["n", 8, 6, 10])],
        [value("y", "float32", ["m", 5])],
        initializer=[weight, dense, shape],
    )
    flops, unknown = model_flops(make_model(graph), {"x": (2, 8, 6, 10)})
    conv_macs = 2 * 16 * 6 * 10 * (4 * 3 * 3)
    matmul_macs = (2 * 16 * 6 * 10 // 10) * 10 * 5  # the Reshape's rows, each a 10 -> 5 product
    assert unknown == 0
    assert flops == 2 * (conv_macs + matmul_macs)


def test_shapes_the_graph_computes_are_counted():
    # MatMul after Shape -> Gather -> Concat -> Reshape: its input shape is data the graph computes.
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero"], ["batch"], axis=0),
        helper.make_node("Concat", ["batch", "minus_one"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["flat"]),
        helper.make_node("MatMul", ["flat", "W"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(np.array([0], np.int64), "zero"),
        numpy_helper.from_array(np.array([-1], np.int64), "minus_one"),
        numpy_helper.from_array(np.zeros((12, 3), np.float32), "W"),
    ]
    graph = helper.make_graph(
        nodes, "folded", [value("x", "float32", ["n", 3, 4])], [value("y", "float32", ["n", 3])], initializer=inits
    )
    flops, unknown = model_flops(make_model(graph), {"x": (5, 3, 4)})
    assert unknown == 0
    assert flops == 2 * 5 * 12 * 3


def test_a_quantized_models_integer_contractions_count_as_their_float_forms(tmp_path):
    """The same convnet quantized statically (QOperator: QLinearConv, QGemm) or in QDQ form, and the same
    encoder quantized dynamically (MatMulInteger): as many operations as their float models."""
    import onnx
    from onnxruntime.quantization import QuantFormat

    from tests import convnets, synthetic
    from tests.compiler.test_quantized import dynamic_quantized_encoder, static_quantized_convnet

    images = {"x": (2, 3, 56, 56)}
    float_convnet = model_flops(onnx.load_from_string(convnets.residual_model()), images)
    for quant_format in (QuantFormat.QDQ, QuantFormat.QOperator):
        quantized = onnx.load_from_string(static_quantized_convnet(tmp_path, quant_format))
        assert model_flops(quantized, images) == float_convnet, quant_format
    encoder = {"x": (2, 16, 64)}
    float_encoder = model_flops(onnx.load_from_string(synthetic.bert_encoder_model(layers=1, hidden=64, heads=4,
                                                                                  seq=16)), encoder)  # fmt: skip
    dynamic = onnx.load_from_string(dynamic_quantized_encoder(tmp_path))
    assert model_flops(dynamic, encoder) == float_encoder and float_encoder[0] > 0
