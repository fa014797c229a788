"""The built-in ``demo`` model: a tiny deterministic MLP classifier, so that a
fresh server answers a prediction with no upload."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

DEMO_NAME = "demo"
DEMO_CONFIG = {"axes": {"batch": {"kind": "pow2", "min": 1, "max": 64}}, "warm_buckets": [{"x": [1, 4]}]}


def demo_model_bytes() -> bytes:
    """x[batch, 4] -> Gemm(4x16) -> Relu -> Gemm(16x3) -> Softmax -> probs[batch, 3]."""
    rng = np.random.default_rng(20261121)
    params = {
        "w1": rng.standard_normal((4, 16)).astype(np.float32) * 0.5,
        "b1": rng.standard_normal(16).astype(np.float32) * 0.1,
        "w2": rng.standard_normal((16, 3)).astype(np.float32) * 0.5,
        "b2": rng.standard_normal(3).astype(np.float32) * 0.1,
    }
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"]),
        helper.make_node("Relu", ["h"], ["hr"]),
        helper.make_node("Gemm", ["hr", "w2", "b2"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "jitserve_demo",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", 3])],
        initializer=[numpy_helper.from_array(v, k) for k, v in params.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="jitserve")
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model.SerializeToString()
