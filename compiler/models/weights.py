"""Weights as kernel parameters: which tensors are weights, the graph's digest
without their values, and the prepared-weights folder a model version keeps
once in the store, shared by every bucket's kernel.

A *weight* is a float tensor of at least :data:`WEIGHT_MIN_ELEMENTS`
elements held by the model (an initializer or a ``Constant`` node). Kernels
take the weights as runtime parameters instead of baking them in, so a
kernel depends on the graph, the shapes, the target and the compiler only:
two versions of one architecture with different weights share their kernels.
Smaller tensors (shape vectors, axes, scalars such as an epsilon) stay
constants in the kernel and their values stay in the graph digest.

A quantized model's int8 weights (:func:`integer_weight_names`) are kernel
parameters too, held once in the prepared folder like the float ones, but
their values stay in the graph digest: a kernel's choices depend on them
(which weights sum exactly in bytes, :mod:`compiler.tvm.integer_matmul`).

A prepared folder (written by the compile child, :mod:`compiler.tvm.prepare`)
holds ``graph.onnx`` (the model with its weight-only subgraphs folded and its
weights turned into graph inputs, no weight bytes), ``weights-2.json`` (the
weights' names, dtypes and shapes, in the kernels' parameter order) and one
``.npy`` file per weight. NumPy aligns ``.npy`` data to 64 bytes, as TVM's
kernels expect, and :func:`load_weights` maps the files copy-on-write: the
pages are read once and shared by every kernel (and every process) using
them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

WEIGHT_MIN_ELEMENTS = 64
"""Smaller float tensors stay constants: importers need some as values (Resize scales, Clip bounds)."""

FLOAT_TYPES = frozenset(
    {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16}
)
INTEGER_TYPES = frozenset({onnx.TensorProto.INT8, onnx.TensorProto.UINT8})
GRAPH_NAME = "graph.onnx"
INDEX_NAME = "weights-2.json"
"""Named by the folder's layout: a folder prepared before int8 weights were parameters has none, and is
prepared again."""


def _elements(tensor: onnx.TensorProto) -> int:
    return int(np.prod(tensor.dims)) if len(tensor.dims) else 1


def is_weight(tensor: onnx.TensorProto) -> bool:
    return tensor.data_type in FLOAT_TYPES and _elements(tensor) >= WEIGHT_MIN_ELEMENTS


def integer_weight_names(model: onnx.ModelProto) -> set[str]:
    """The int8/uint8 initializers of at least :data:`WEIGHT_MIN_ELEMENTS` elements read only as quantized
    weights: ``DequantizeLinear``'s input, ``MatMulInteger``'s ``B``, a ``Gather``'s table (a quantized
    embedding, dequantized after the lookup). Any other reader may need the value at
    import (a shape, an index), so such a tensor stays a constant."""
    readers: dict[str, list[tuple[str, int]]] = {}
    for node in model.graph.node:
        for position, name in enumerate(node.input):
            readers.setdefault(name, []).append((node.op_type, position))
    weight_reads = {("DequantizeLinear", 0), ("MatMulInteger", 1), ("Gather", 0)}
    inputs = {value.name for value in model.graph.input}
    return {
        tensor.name
        for tensor in model.graph.initializer
        if tensor.data_type in INTEGER_TYPES
        and _elements(tensor) >= WEIGHT_MIN_ELEMENTS
        and tensor.name not in inputs
        and readers.get(tensor.name)
        and all(read in weight_reads for read in readers[tensor.name])
    }


def constant_value(node: onnx.NodeProto) -> onnx.TensorProto | None:
    """The tensor of a ``Constant`` node given as a tensor (``value``), else None."""
    if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and len(node.attribute) == 1:
        attribute = node.attribute[0]
        if attribute.name == "value" and attribute.HasField("t"):
            return attribute.t
    return None


def _spec(name: str, tensor: onnx.TensorProto) -> bytes:
    return json.dumps(["weight", name, int(tensor.data_type), list(tensor.dims)]).encode()


def graph_digest(model: onnx.ModelProto) -> str:
    """sha256 of the model with every weight reduced to its name, dtype and shape: what a kernel compiled
    with the weights as parameters depends on. Everything else (nodes, small constants, opsets, functions,
    the inputs' and outputs' types) counts by value. Reads the proto in place, copying no weight."""
    digest = hashlib.sha256()
    graph = model.graph
    for opset in model.opset_import:
        digest.update(opset.SerializeToString(deterministic=True))
    for part in (*graph.input, *graph.output):
        digest.update(part.SerializeToString(deterministic=True))
    for tensor in graph.initializer:
        digest.update(_spec(tensor.name, tensor) if is_weight(tensor) else tensor.SerializeToString(deterministic=True))
    for tensor in graph.sparse_initializer:
        digest.update(tensor.SerializeToString(deterministic=True))
    for node in graph.node:
        value = constant_value(node)
        if value is not None and is_weight(value):
            digest.update(_spec(node.output[0], value))
        else:
            digest.update(node.SerializeToString(deterministic=True))
    for function in model.functions:
        digest.update(function.SerializeToString(deterministic=True))
    return digest.hexdigest()


def _copy_fields(source, target, skip: str) -> None:
    """Copy every set field of one proto into an empty one of its type, but ``skip``."""
    for descriptor, value in source.ListFields():
        if descriptor.name == skip:
            continue
        if descriptor.is_repeated:
            getattr(target, descriptor.name).extend(value)
        elif descriptor.message_type is not None:
            getattr(target, descriptor.name).CopyFrom(value)
        else:
            setattr(target, descriptor.name, value)


def weightless(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with each weight initializer turned into a graph input of its dtype and shape: what the
    checker and shape inference need, without copying the weights (each of them serializes the whole
    model: seconds and gigabytes for a BERT-sized one). Nothing that depends on a weight's values
    (shapes, static sizes) is lost: weights are float tensors, never shapes."""
    light = onnx.ModelProto()
    _copy_fields(model, light, skip="graph")
    graph = light.graph
    _copy_fields(model.graph, graph, skip="initializer")
    for tensor in model.graph.initializer:
        if is_weight(tensor):
            graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, tensor.dims))
        else:
            graph.initializer.append(tensor)
    return light


def weight_data_problem(model: onnx.ModelProto) -> str | None:
    """A weight initializer whose data does not hold as many elements as its dims say (the checker,
    run on :func:`weightless`, no longer sees the data), else None."""
    for tensor in model.graph.initializer:
        if not is_weight(tensor):
            continue
        if tensor.HasField("raw_data"):
            itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
            held, wanted, unit = len(tensor.raw_data), _elements(tensor) * itemsize, "bytes"
        else:  # typed fields hold one value per element (float16 in int32_data too)
            held = len(getattr(tensor, onnx.helper.tensor_dtype_to_field(tensor.data_type)))
            wanted, unit = _elements(tensor), "values"
        if held != wanted:
            dims = list(tensor.dims)
            return f"initializer {tensor.name!r} holds {held} {unit} of data, its dims {dims} need {wanted}"
    return None


def weight_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the model's weights (initializers and Constant nodes of the main graph), a quantized model's
    int8 ones (:func:`integer_weight_names`) too: what memory admission weighs a model by. A QDQ BERT-base
    holds 85 of its 109 MB in int8."""
    total = 0
    integer = integer_weight_names(model)
    tensors = [*model.graph.initializer, *(t for n in model.graph.node if (t := constant_value(n)) is not None)]
    for tensor in tensors:
        if is_weight(tensor) or tensor.name in integer:
            total += _elements(tensor) * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    return total


@dataclass(frozen=True)
class WeightSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]


def save_prepared(directory: Path, graph: onnx.ModelProto, weights: dict[str, np.ndarray]) -> None:
    """Write a prepared folder: the weight-free graph, the index, one ``.npy`` per weight (in order)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / GRAPH_NAME).write_bytes(graph.SerializeToString())
    index = []
    for number, (name, array) in enumerate(weights.items()):
        file = f"{number:05d}.npy"
        np.save(directory / file, np.ascontiguousarray(array))
        index.append({"name": name, "dtype": str(array.dtype), "shape": list(array.shape), "file": file})
    (directory / INDEX_NAME).write_text(json.dumps(index))


def read_index(directory: Path) -> list[dict]:
    return json.loads((directory / INDEX_NAME).read_text())


def load_weights(directory: Path) -> dict[str, np.ndarray]:
    """The prepared weights, mapped copy-on-write (writable for DLPack, never written)."""
    return {entry["name"]: np.load(directory / entry["file"], mmap_mode="c") for entry in read_index(directory)}


def prepared_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.iterdir() if path.is_file())
