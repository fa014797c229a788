"""The load-test model and its request shapes.

A per-token MLP, ``x[batch, seq, 16] -> y[batch, seq, 8]``: both axes pass the
padding-safety check, so thousands of distinct (batch, seq) shapes map onto
the few pow2 buckets of the config below.
"""

from __future__ import annotations

import random

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

MAX_BATCH, MAX_SEQ, FEATURES = 32, 64, 16
CONFIG = {
    "axes": {
        "batch": {"kind": "pow2", "min": 1, "max": MAX_BATCH},
        "seq": {"kind": "pow2", "min": 1, "max": MAX_SEQ},
    },
    "probe_sizes": {"batch": 3, "seq": 5},
}
# The steady traffic: a handful of shapes most requests use.
STEADY_SHAPES = [(1, 16), (4, 32), (8, 8), (2, 64)]


def token_mlp_bytes() -> bytes:
    rng = np.random.default_rng(2026)
    weights = {
        "w1": rng.standard_normal((FEATURES, 32)).astype(np.float32) * 0.3,
        "w2": rng.standard_normal((32, 8)).astype(np.float32) * 0.3,
    }
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h"]),
            helper.make_node("Relu", ["h"], ["hr"]),
            helper.make_node("MatMul", ["hr", "w2"], ["y"]),
        ],
        "token_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", FEATURES])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 8])],
        initializer=[numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model.SerializeToString()


def long_tail_shape(rng: random.Random) -> tuple[int, int]:
    return rng.randint(1, MAX_BATCH), rng.randint(1, MAX_SEQ)


def payload(shape: tuple[int, int], rng: np.random.Generator) -> dict:
    return {"inputs": {"x": rng.standard_normal((*shape, FEATURES)).astype(np.float32)}}
