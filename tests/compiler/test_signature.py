"""compiler.models.signature.read_signature: dtypes, dims and symbolic axes."""

from __future__ import annotations

import onnx
import pytest
from onnx import helper

from compiler.errors import InvalidModelError
from compiler.models.signature import Signature, TensorSpec, read_signature
from tests import synthetic
from tests.synthetic import make_model, value


def _signature(data: bytes) -> Signature:
    return read_signature(onnx.load_from_string(data))


@pytest.mark.parametrize("dtype", ["float32", "float16", "int64"])
def test_dtype_and_dims(dtype):
    signature = _signature(synthetic.add_model(dtype))
    assert signature.inputs == (TensorSpec("x", dtype, ("batch", 4)),)
    assert signature.outputs == (TensorSpec("y", dtype, ("batch", 4)),)
    assert signature.input("x").rank == 2
    assert signature.input("x").symbolic_axes() == [(0, "batch")]


def test_unknown_input_name_raises_key_error():
    with pytest.raises(KeyError):
        _signature(synthetic.add_model()).input("nope")


def test_static_dims_are_ints():
    signature = _signature(synthetic.unsupported_op_model())
    assert signature.input("x").dims == (2, 3, 3)
    assert signature.input("x").symbolic_axes() == []
    assert signature.axes() == {}


def test_initializers_are_not_inputs():
    model = onnx.load_from_string(synthetic.two_input_model())
    # Old exporters list initializers among the graph inputs as well.
    model.graph.input.append(helper.make_tensor_value_info("W", onnx.TensorProto.FLOAT, [8, 8]))
    signature = read_signature(model)
    assert signature.input_names == ["a", "b"]
    assert signature.output_names == ["y"]


def test_named_axis_shared_across_two_inputs():
    signature = _signature(synthetic.two_input_model())
    assert signature.input("a").dims == ("batch", 8)
    assert signature.input("b").dims == ("batch", 8)
    assert signature.axes() == {"batch": [("a", 0), ("b", 0)]}


def test_to_json_lists_axis_places():
    document = _signature(synthetic.two_input_model()).to_json()
    assert document["inputs"][0] == {"name": "a", "dtype": "float32", "dims": ["batch", 8]}
    assert document["symbolic_axes"] == {"batch": [{"input": "a", "axis": 0}, {"input": "b", "axis": 0}]}


def test_unnamed_dim_gets_a_name_per_input_and_axis():
    signature = _signature(synthetic.unnamed_axis_model())
    assert signature.input("x").dims == ("x:0", 6)
    assert signature.axes() == {"x:0": [("x", 0)]}
    assert signature.outputs[0].dims == ("y:0", 6)


def test_two_unnamed_dims_are_distinct_axes():
    signature = _signature(synthetic.relu_model([None, None]))
    assert signature.input("x").dims == ("x:0", "x:1")
    assert signature.axes() == {"x:0": [("x", 0)], "x:1": [("x", 1)]}


def test_unnamed_dims_of_two_inputs_are_distinct_axes():
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["y"])],
        "two_unnamed",
        [value("a", "float32", [None, 4]), value("b", "float32", [None, 4])],
        [value("y", "float32", [None, 4])],
    )
    signature = read_signature(make_model(graph))
    assert signature.axes() == {"a:0": [("a", 0)], "b:0": [("b", 0)]}


@pytest.mark.parametrize("placeholder", ["?", "-1", "", " ", "batch size", "1x"])
def test_placeholder_dim_param_is_unnamed(placeholder):
    model = onnx.load_from_string(synthetic.relu_model(["batch", 6]))
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = placeholder
    assert read_signature(model).input("x").dims == ("x:0", 6)


def test_two_placeholder_dims_do_not_share_an_axis():
    model = onnx.load_from_string(synthetic.relu_model(["batch", "batch"]))
    for dim in model.graph.input[0].type.tensor_type.shape.dim:
        dim.dim_param = "?"
    assert read_signature(model).axes() == {"x:0": [("x", 0)], "x:1": [("x", 1)]}


@pytest.mark.parametrize("name", ["batch", "seq_len", "N", "unk__12", "dim.0", "a-b"])
def test_ordinary_dim_params_are_kept(name):
    model = onnx.load_from_string(synthetic.relu_model([name, 6]))
    assert read_signature(model).input("x").dims == (name, 6)


def test_negative_dim_value_is_unnamed():
    model = onnx.load_from_string(synthetic.relu_model([3, 6]))
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = -1
    assert read_signature(model).input("x").dims == ("x:0", 6)


def test_input_without_shape_is_rejected():
    model = onnx.load_from_string(synthetic.relu_model([3, 6]))
    model.graph.input[0].type.tensor_type.ClearField("shape")
    with pytest.raises(InvalidModelError, match="no shape"):
        read_signature(model)


def test_unsupported_dtype_is_rejected_naming_the_input():
    model = onnx.load_from_string(synthetic.add_model())
    model.graph.input[0].type.tensor_type.elem_type = onnx.TensorProto.COMPLEX64
    with pytest.raises(InvalidModelError, match=r"input 'x' has unsupported dtype COMPLEX64"):
        read_signature(model)


def test_model_whose_only_inputs_are_initializers_is_rejected():
    model = onnx.load_from_string(synthetic.two_input_model())
    del model.graph.input[:]
    with pytest.raises(InvalidModelError, match="no inputs"):
        read_signature(model)
