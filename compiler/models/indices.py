"""Which integer inputs index into a tensor, and within what range.

TVM compiles ``take`` (ONNX ``Gather``) in fast mode: an index out of range
reads out of bounds (garbage, or a segfault of the serving process), where
ONNX Runtime refuses the input. So before any kernel runs, every integer
input that reaches an index operand is range-checked against the indexed
dimension, ``[-n, n-1]`` as ONNX allows. Values are followed from each integer
input through every node: straight through ops that only move values
(reshape, cast, concat, ...), and as *computed* values through the rest. An
index reached by computed values, or whose dimension is not static, has no
bound that a request can be checked against: such a model is never served by
a kernel (ONNX Runtime serves it, and refuses what it refuses).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import onnx

# op type -> (index operand position, the attribute naming the indexed axis of operand 0)
INDEX_OPERANDS = {
    "Gather": (1, "axis"),
    "GatherElements": (1, "axis"),
    "ScatterElements": (1, "axis"),
    "GatherND": (1, None),
    "ScatterND": (1, None),
}
# Ops whose outputs hold (some of) the values of these input positions, unchanged.
MOVES_VALUES = {
    "Identity": None,
    "Cast": None,
    "Reshape": {0},
    "Squeeze": {0},
    "Unsqueeze": {0},
    "Flatten": {0},
    "Transpose": {0},
    "Expand": {0},
    "Tile": {0},
    "Slice": {0},
    "Split": {0},
    "Concat": None,
    "Gather": {0},
    "Where": {1, 2},
}
# Ops whose outputs do not depend on the values of their inputs (shapes only), or are
# in range by construction (positions of the input itself).
VALUE_FREE = {"Shape", "Size", "EyeLike", "RandomNormalLike", "RandomUniformLike", "ArgMax", "ArgMin", "NonZero"}
INTEGER_TYPES = {
    onnx.TensorProto.INT8,
    onnx.TensorProto.INT16,
    onnx.TensorProto.INT32,
    onnx.TensorProto.INT64,
    onnx.TensorProto.UINT8,
    onnx.TensorProto.UINT16,
    onnx.TensorProto.UINT32,
    onnx.TensorProto.UINT64,
}


@dataclass(frozen=True)
class IndexUse:
    """An input whose values index a dimension of size ``size`` (None: no bound can be checked)."""

    input: str
    node: str
    size: int | None

    @property
    def checkable(self) -> bool:
        return self.size is not None

    def describe(self) -> str:
        if self.size is None:
            return f"input {self.input!r} reaches the index of {self.node} with no bound a request can be checked by"
        return f"input {self.input!r} indexes {self.node}: valid values are [{-self.size}, {self.size - 1}]"


@dataclass(frozen=True)
class IndexBounds:
    uses: tuple[IndexUse, ...] = ()

    @cached_property
    def ranges(self) -> dict[str, tuple[int, int, str]]:
        """input -> (low, high, what it indexes) for every input with checkable uses (the tightest)."""
        found: dict[str, tuple[int, int, str]] = {}
        for use in self.uses:
            if use.size is not None and (use.input not in found or use.size - 1 < found[use.input][1]):
                found[use.input] = (-use.size, use.size - 1, use.node)
        return found

    @property
    def limits(self) -> dict[str, int]:
        """input -> the size of the smallest dimension it indexes: seeded test inputs stay below it."""
        return {name: high + 1 for name, (_, high, _) in self.ranges.items()}

    @property
    def unchecked(self) -> list[IndexUse]:
        return [use for use in self.uses if not use.checkable]


def _static_shapes(model: onnx.ModelProto) -> dict[str, list[int | None]]:
    shapes: dict[str, list[int | None]] = {init.name: list(init.dims) for init in model.graph.initializer}
    try:
        inferred = onnx.shape_inference.infer_shapes(model).graph
    except Exception:  # noqa: BLE001 - inference is a help, not a requirement
        inferred = model.graph
    for value in [*inferred.value_info, *inferred.input, *inferred.output]:
        if value.name in shapes or not value.type.tensor_type.HasField("shape"):
            continue
        dims = value.type.tensor_type.shape.dim
        shapes[value.name] = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in dims]
    return shapes


def _subgraph_names(graph: onnx.GraphProto) -> set[str]:
    """Every tensor name the subgraphs of ``graph``'s nodes read (they may capture outer names)."""
    names: set[str] = set()
    for node in graph.node:
        for attribute in node.attribute:
            for sub in [attribute.g, *attribute.graphs] if attribute.HasField("g") else attribute.graphs:
                for inner in sub.node:
                    names.update(inner.input)
                names |= _subgraph_names(sub)
    return names


def _indexed_size(node: onnx.NodeProto, shapes: dict[str, list[int | None]]) -> int | None:
    _, axis_attribute = INDEX_OPERANDS[node.op_type]
    if axis_attribute is None:  # GatherND / ScatterND: one index per leading axis
        return None
    data = shapes.get(node.input[0])
    if not data:
        return None
    axis = next((a.i for a in node.attribute if a.name == axis_attribute), 0)
    axis = axis + len(data) if axis < 0 else axis
    return data[axis] if 0 <= axis < len(data) else None


def index_bounds(model: onnx.ModelProto) -> IndexBounds:
    graph = model.graph
    initializers = {init.name for init in graph.initializer}
    sources = [
        v.name for v in graph.input if v.name not in initializers and v.type.tensor_type.elem_type in INTEGER_TYPES
    ]
    if not sources:
        return IndexBounds()
    shapes = _static_shapes(model)
    consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in graph.node:
        for position, name in enumerate(node.input):
            consumers.setdefault(name, []).append((node, position))
    captured = _subgraph_names(graph)

    uses = []
    for source in sources:
        # tensor -> whether it holds the input's values unchanged (else values computed from them)
        reached = {source: True}
        pending = [source]
        while pending:
            tensor = pending.pop()
            exact = reached[tensor]
            if tensor in captured:
                uses.append(IndexUse(source, "a subgraph (If/Loop/Scan)", None))
            for node, position in consumers.get(tensor, []):
                label = f"{node.op_type} {node.name!r}" if node.name else node.op_type
                if node.op_type in INDEX_OPERANDS and position == INDEX_OPERANDS[node.op_type][0]:
                    uses.append(IndexUse(source, label, _indexed_size(node, shapes) if exact else None))
                if node.op_type in VALUE_FREE:
                    continue
                moved = MOVES_VALUES.get(node.op_type, set())
                keeps = exact and (moved is None or position in moved)
                for output in node.output:
                    # Computed values win: a tensor is exact only while every way in keeps the values.
                    if output and (output not in reached or (reached[output] and not keeps)):
                        reached[output] = keeps
                        pending.append(output)
    return IndexBounds(tuple(dict.fromkeys(uses)))
