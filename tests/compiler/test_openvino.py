"""OpenVINO as an engine: built for a bucket from the ONNX model itself, verified against ONNX Runtime,
in fp32, and refusing a request its bucket does not take."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from compiler.engines import OrtEngine
from compiler.errors import BadRequestError, CompileError
from compiler.model import load_model
from compiler.openvino_engine import OpenVinoEngine, verify_openvino
from tests import convnets, synthetic
from tests.realmodels import REC, real_model

MODELS = {
    "PP-OCRv4 rec": (lambda: real_model(REC).read_bytes(), {"x": (2, 3, 48, 320)}),
    "mobile convnet": (convnets.mobile_model, {"x": (2, 3, 56, 56)}),
    "BERT-style encoder": (synthetic.bert_encoder_model, {"x": (2, 128, 256)}),
    "causal decoder (int64 ids)": (synthetic.causal_decoder_model, {"ids": (1, 24)}),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_openvino_verifies_against_onnx_runtime_on_the_bucket(name):
    make, bucket = MODELS[name]
    data = make()
    model = load_model(data, max_bytes=1 << 26)
    dtypes = {s.name: s.dtype for s in model.signature.inputs}
    reference = OrtEngine(data)
    engine = OpenVinoEngine(data, bucket, model.signature.output_names, threads=2)
    verified, detail = verify_openvino(
        engine, reference, bucket, dtypes, rtol=1e-3, atol=1e-4, seed=0, index_limits=model.index_bounds.limits
    )
    assert verified, detail
    assert engine.nbytes >= 0 and engine.name == "openvino"
    # Other inputs than those it was verified on, answered as ONNX Runtime answers them.
    rng = np.random.default_rng(5)
    inputs = {
        s.name: rng.integers(0, 97, bucket[s.name]).astype(np.int64)
        if s.dtype == "int64"
        else rng.standard_normal(bucket[s.name]).astype(np.float32)
        for s in model.signature.inputs
    }
    got, want = engine.run(inputs), reference.run(inputs)
    assert list(got) == model.signature.output_names
    for output in want:
        np.testing.assert_allclose(got[output], want[output], rtol=1e-3, atol=1e-4)


def test_a_request_of_another_shape_is_refused_with_the_reason():
    data = convnets.mobile_model()
    engine = OpenVinoEngine(data, {"x": (2, 3, 56, 56)}, ["y"])
    with pytest.raises(BadRequestError, match=r"openvino refused the input: .*\[1,3,56,56\].*\[2,3,56,56\]"):
        engine.run({"x": np.zeros((1, 3, 56, 56), np.float32)})


def test_a_model_openvino_cannot_read_is_a_compile_error_not_a_crash():
    graph = helper.make_graph(
        [helper.make_node("Frobnicate", ["x"], ["y"], domain="com.example")],
        "unknown", [synthetic.value("x", "float32", [2, 4])], [synthetic.value("y", "float32", [2, 4])],
    )  # fmt: skip
    model = synthetic.make_model(graph, check=False)
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    with pytest.raises(CompileError, match=r"openvino cannot compile the model: .*com\.example\.Frobnicate"):
        OpenVinoEngine(model.SerializeToString(), {"x": (2, 4)}, ["y"])
