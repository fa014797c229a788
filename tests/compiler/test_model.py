"""compiler.models.model.load_model: what it accepts and how it refuses the rest."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.errors import InvalidModelError, PayloadTooLargeError
from compiler.models.model import LoadedModel, load_model, load_model_file, model_digest
from tests import synthetic
from tests.synthetic import make_model, value

MAX_BYTES = 1 << 20

VALID_MODELS = {
    "add_float32": lambda: synthetic.add_model("float32"),
    "add_float16": lambda: synthetic.add_model("float16"),
    "add_int64": lambda: synthetic.add_model("int64"),
    "two_input": synthetic.two_input_model,
    "unnamed_axis": synthetic.unnamed_axis_model,
    "unsupported_op": synthetic.unsupported_op_model,
    "batch_mix": synthetic.batch_mix_model,
}


def _rejected(data: bytes, **kwargs) -> InvalidModelError:
    with pytest.raises(InvalidModelError) as info:
        load_model(data, max_bytes=kwargs.pop("max_bytes", MAX_BYTES), **kwargs)
    assert info.value.http_status == 422
    return info.value


def _external_tensor(name: str, location: str, count: int = 4) -> TensorProto:
    tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=[count])
    tensor.data_location = TensorProto.EXTERNAL
    for key, text in (("location", location), ("offset", "0"), ("length", str(4 * count))):
        tensor.external_data.add(key=key, value=text)
    return tensor


@pytest.fixture
def secret_in_cwd(tmp_path, monkeypatch) -> str:
    """A file next to the process's cwd: what a model must never get to read.

    onnx.checker refuses external data whose file does not exist, so the
    dangerous case is exactly a location that resolves to a real file.
    """
    monkeypatch.chdir(tmp_path)
    (tmp_path / "secret.bin").write_bytes(b"top secret bytes")
    return "secret.bin"


@pytest.mark.parametrize("name", sorted(VALID_MODELS))
def test_accepts_synthetic_models(name):
    data = VALID_MODELS[name]()
    loaded = load_model(data, max_bytes=MAX_BYTES)
    assert isinstance(loaded, LoadedModel)
    assert loaded.data == data
    assert loaded.digest == model_digest(data)
    assert len(loaded.digest) == 64
    assert loaded.opset == synthetic.OPSET
    assert loaded.signature.inputs


def test_digest_is_content_addressed():
    first = load_model(synthetic.two_input_model(), max_bytes=MAX_BYTES)
    again = load_model(synthetic.two_input_model(), max_bytes=MAX_BYTES)
    other = load_model(synthetic.batch_mix_model(), max_bytes=MAX_BYTES)
    assert first.digest == again.digest
    assert first.digest != other.digest


def test_load_model_file(tmp_path):
    path = tmp_path / "model.onnx"
    path.write_bytes(synthetic.two_input_model())
    assert load_model_file(str(path), max_bytes=MAX_BYTES).signature.input_names == ["a", "b"]
    with pytest.raises(PayloadTooLargeError):
        load_model_file(str(path), max_bytes=16)
    with pytest.raises(InvalidModelError, match="cannot read"):
        load_model_file(str(tmp_path / "missing.onnx"), max_bytes=MAX_BYTES)


@pytest.mark.parametrize("seed", range(5))
def test_rejects_random_garbage(seed):
    garbage = np.random.default_rng(seed).bytes(2048)
    assert "not an ONNX model" in str(_rejected(garbage))


def test_rejects_truncated_model():
    data = synthetic.two_input_model()
    error = _rejected(data[: len(data) // 2])
    assert "truncated" in str(error)


def test_rejects_empty_bytes():
    assert "empty" in str(_rejected(b""))


def test_rejects_a_proto_without_graph():
    assert "empty graph" in str(_rejected(onnx.ModelProto(ir_version=8).SerializeToString()))


def test_rejects_external_data_reference():
    error = _rejected(synthetic.external_data_model())
    assert "external data" in str(error)
    assert "../../etc/passwd" in str(error)
    assert "'W'" in str(error)


def test_rejects_external_data_inside_a_subgraph():
    branch = helper.make_graph(
        [helper.make_node("Identity", ["C"], ["out"])],
        "branch",
        [],
        [value("out", "float32", [4])],
        initializer=[_external_tensor("C", "weights.bin")],
    )
    graph = helper.make_graph(
        [helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=branch)],
        "with_if",
        [value("cond", "bool", [])],
        [value("y", "float32", [4])],
    )
    error = _rejected(make_model(graph, check=False).SerializeToString())
    assert "external data" in str(error)
    assert "weights.bin" in str(error)


def test_rejects_external_data_in_a_constant_attribute():
    graph = helper.make_graph(
        [
            helper.make_node("Constant", [], ["W"], value=_external_tensor("cw", "weights.bin")),
            helper.make_node("Add", ["x", "W"], ["y"]),
        ],
        "constant_attr",
        [value("x", "float32", ["batch", 4])],
        [value("y", "float32", ["batch", 4])],
    )
    assert "external data" in str(_rejected(make_model(graph, check=False).SerializeToString()))


def test_rejects_external_data_in_a_sparse_constant_attribute(secret_in_cwd):
    indices = numpy_helper.from_array(np.array([0, 1], dtype=np.int64), "indices")
    sparse = helper.make_sparse_tensor(_external_tensor("values", secret_in_cwd, 2), indices, [4])
    graph = helper.make_graph(
        [
            helper.make_node("Constant", [], ["W"], sparse_value=sparse),
            helper.make_node("Add", ["x", "W"], ["y"]),
        ],
        "sparse_attr",
        [value("x", "float32", ["batch", 4])],
        [value("y", "float32", ["batch", 4])],
    )
    assert "external data" in str(_rejected(make_model(graph, check=False).SerializeToString()))


def test_rejects_external_data_inside_a_model_local_function(secret_in_cwd):
    function = helper.make_function(
        "local",
        "AddW",
        ["x"],
        ["y"],
        [
            helper.make_node("Constant", [], ["W"], value=_external_tensor("fw", secret_in_cwd)),
            helper.make_node("Add", ["x", "W"], ["y"]),
        ],
        [helper.make_opsetid("", synthetic.OPSET)],
    )
    graph = helper.make_graph(
        [helper.make_node("AddW", ["x"], ["y"], domain="local")],
        "with_function",
        [value("x", "float32", ["batch", 4])],
        [value("y", "float32", ["batch", 4])],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", synthetic.OPSET), helper.make_opsetid("local", 1)],
        functions=[function],
    )
    model.ir_version = synthetic.IR_VERSION
    assert "external data" in str(_rejected(model.SerializeToString()))


def test_rejects_opset_below_min():
    error = _rejected(synthetic.add_model(), min_opset=18)
    assert "opset 17" in str(error)
    assert "18.." in str(error)


def test_rejects_opset_above_max():
    error = _rejected(synthetic.add_model(), max_opset=16)
    assert "opset 17" in str(error)
    assert "..16" in str(error)


def test_accepts_opset_at_the_bounds():
    assert load_model(synthetic.add_model(), max_bytes=MAX_BYTES, min_opset=17, max_opset=17).opset == 17


def test_rejects_model_without_default_opset():
    model = onnx.load_from_string(synthetic.add_model())
    del model.opset_import[:]
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    assert "opset" in str(_rejected(model.SerializeToString()))


def test_rejects_model_failing_the_checker():
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "undefined_tensor"], ["y"])],
        "dangling",
        [value("x", "float32", ["batch", 4])],
        [value("y", "float32", ["batch", 4])],
    )
    error = _rejected(make_model(graph, check=False).SerializeToString())
    assert str(error).startswith("onnx checker:")
    assert "undefined_tensor" in str(error)
    assert "\n" not in str(error)


def test_rejects_model_failing_shape_inference():
    # MatMul of [batch, 4] by [5, 3]: structurally fine, inconsistent shapes.
    weight = numpy_helper.from_array(np.zeros((5, 3), dtype=np.float32), "W")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "bad_shapes",
        [value("x", "float32", ["batch", 4])],
        [value("y", "float32", ["batch", 3])],
        initializer=[weight],
    )
    assert str(_rejected(make_model(graph, check=False).SerializeToString())).startswith("onnx checker:")


def test_rejects_unsupported_input_dtype():
    graph = helper.make_graph(
        [helper.make_node("Identity", ["text"], ["y"])],
        "strings",
        [value("text", "string", ["batch"])],
        [value("y", "string", ["batch"])],
    )
    error = _rejected(make_model(graph).SerializeToString())
    assert "'text'" in str(error)
    assert "STRING" in str(error)


def test_rejects_non_tensor_input():
    graph = helper.make_graph(
        [helper.make_node("SequenceLength", ["seq"], ["y"])],
        "sequence",
        [helper.make_tensor_sequence_value_info("seq", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("y", TensorProto.INT64, [])],
    )
    assert "not a tensor" in str(_rejected(make_model(graph).SerializeToString()))


def test_payload_too_large():
    data = synthetic.two_input_model()
    with pytest.raises(PayloadTooLargeError) as info:
        load_model(data, max_bytes=len(data) - 1)
    assert info.value.http_status == 413
    assert str(len(data)) in str(info.value)
    assert load_model(data, max_bytes=len(data)).data == data


def test_size_limit_applies_before_parsing():
    with pytest.raises(PayloadTooLargeError):
        load_model(b"\xff" * 100, max_bytes=99)
