"""Prepare a model version's weights once, in a child: fold the weight-only
subgraphs (onnxsim: BatchNormalization into Conv, transposes and casts of
weights) with the input shapes left symbolic, then turn every weight into a
graph input. Every bucket's kernel takes these prepared weights as
parameters; the server maps them from the store once per model version.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxsim
from onnx import numpy_helper

from ..measuring.profile import named_nodes
from ..models.qoperator import qoperator_as_qdq
from ..models.weights import constant_value, integer_weight_names, is_weight, save_prepared


def fold_weights(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnxsim over the model as uploaded (shapes symbolic): what depends on the weights alone is
    computed once here instead of in every kernel run. A model onnxsim cannot handle is kept as it is.
    Unnamed nodes are named first, as ONNX Runtime's profile knows them (onnxsim names them its own way)."""
    named_nodes(model)
    try:
        folded, ok = onnxsim.simplify(model)
    except Exception:  # noqa: BLE001 - onnxsim raises anything
        return model
    return folded if ok else model


def split_weights(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The model with every weight (initializer or Constant node, and the int8 weights of a quantized one)
    turned into a graph input after the model's own inputs, and the weights in that order."""
    graph = onnx.ModelProto()
    graph.CopyFrom(model)
    inputs = {value.name for value in graph.graph.input}
    integer = integer_weight_names(graph)
    weights: dict[str, np.ndarray] = {}

    def take(name: str, tensor: onnx.TensorProto) -> None:
        weights[name] = numpy_helper.to_array(tensor)
        graph.graph.input.append(onnx.helper.make_tensor_value_info(name, tensor.data_type, list(tensor.dims)))

    kept = []
    for tensor in graph.graph.initializer:
        if (is_weight(tensor) or tensor.name in integer) and tensor.name not in inputs:  # an input is overridable
            take(tensor.name, tensor)
        else:
            kept.append(tensor)
    nodes = []
    for node in graph.graph.node:
        value = constant_value(node)
        if value is not None and is_weight(value):
            take(node.output[0], value)
        else:
            nodes.append(node)
    graph.graph.ClearField("initializer")
    graph.graph.initializer.extend(kept)
    graph.graph.ClearField("node")
    graph.graph.node.extend(nodes)
    return graph, weights


def prepare(model_bytes: bytes, directory: Path, simplify: bool) -> dict:
    """Write the prepared folder of ``model_bytes`` into ``directory``; returns its facts."""
    model = onnx.load_from_string(model_bytes)
    model = qoperator_as_qdq(model) or model  # the compiled tier keeps a QDQ graph's convs in integers
    graph, weights = split_weights(fold_weights(model) if simplify else model)
    save_prepared(directory, graph, weights)
    return {"weights": len(weights), "weight_bytes": sum(array.nbytes for array in weights.values())}
