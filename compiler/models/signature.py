"""Model signature: inputs and outputs with dtypes and dims.

A dim is either a static ``int`` or the name of a symbolic axis. Named
``dim_param`` values are kept (two inputs sharing ``batch`` share one axis);
unnamed or placeholder dims (``-1``, ``?``, empty) get a unique name per
tensor and axis, ``"<tensor>:<axis>"``, because TVM's importer would otherwise
tie every unnamed dim to one variable.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

import onnx

from ..errors import InvalidModelError

# ONNX element type -> numpy dtype name, for the dtypes both engines handle.
SUPPORTED_DTYPES: dict[int, str] = {
    onnx.TensorProto.FLOAT: "float32",
    onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.DOUBLE: "float64",
    onnx.TensorProto.INT8: "int8",
    onnx.TensorProto.INT16: "int16",
    onnx.TensorProto.INT32: "int32",
    onnx.TensorProto.INT64: "int64",
    onnx.TensorProto.UINT8: "uint8",
    onnx.TensorProto.BOOL: "bool",
}

_AXIS_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")

Dim = int | str


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    dims: tuple[Dim, ...]

    @property
    def rank(self) -> int:
        return len(self.dims)

    def symbolic_axes(self) -> list[tuple[int, str]]:
        """(index, axis name) for every symbolic dim."""
        return [(i, d) for i, d in enumerate(self.dims) if isinstance(d, str)]


@dataclass(frozen=True)
class Signature:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def input(self, name: str) -> TensorSpec:
        for spec in self.inputs:
            if spec.name == name:
                return spec
        raise KeyError(name)

    @property
    def input_names(self) -> list[str]:
        return [spec.name for spec in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [spec.name for spec in self.outputs]

    def with_static_inputs(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """``shapes`` plus the one shape of every input it leaves out that has no symbolic axis (scalars too)."""
        static = {s.name: tuple(s.dims) for s in self.inputs if s.name not in shapes and not s.symbolic_axes()}
        return {**shapes, **static}

    def axes(self) -> dict[str, list[tuple[str, int]]]:
        """Symbolic axis name -> every (input, index) that carries it."""
        found: dict[str, list[tuple[str, int]]] = {}
        for spec in self.inputs:
            for index, axis in spec.symbolic_axes():
                found.setdefault(axis, []).append((spec.name, index))
        return found

    def leading_axis(self) -> str | None:
        """The symbolic axis that is dim 0 of every input (the batch, where the model has one), if any."""
        firsts = {spec.dims[0] if spec.dims else None for spec in self.inputs}
        axis = firsts.pop() if len(firsts) == 1 else None
        return axis if isinstance(axis, str) else None

    def to_json(self) -> dict:
        return {
            "inputs": [asdict(s) | {"dims": list(s.dims)} for s in self.inputs],
            "outputs": [asdict(s) | {"dims": list(s.dims)} for s in self.outputs],
            "symbolic_axes": {
                axis: [{"input": name, "axis": index} for name, index in places] for axis, places in self.axes().items()
            },
        }


def _dims(value: onnx.ValueInfoProto) -> tuple[Dim, ...]:
    dims: list[Dim] = []
    for index, dim in enumerate(value.type.tensor_type.shape.dim):
        if dim.HasField("dim_value") and dim.dim_value > 0:
            dims.append(int(dim.dim_value))
        elif dim.HasField("dim_param") and _AXIS_NAME.match(dim.dim_param):
            dims.append(dim.dim_param)
        else:
            dims.append(f"{value.name}:{index}")
    return tuple(dims)


def _spec(value: onnx.ValueInfoProto, role: str) -> TensorSpec:
    if value.type.WhichOneof("value") != "tensor_type":
        raise InvalidModelError(f"{role} {value.name!r} is not a tensor")
    elem_type = value.type.tensor_type.elem_type
    if elem_type not in SUPPORTED_DTYPES:
        type_name = onnx.TensorProto.DataType.Name(elem_type)
        raise InvalidModelError(
            f"{role} {value.name!r} has unsupported dtype {type_name}; "
            f"supported: {', '.join(sorted(set(SUPPORTED_DTYPES.values())))}"
        )
    if not value.type.tensor_type.HasField("shape"):
        raise InvalidModelError(f"{role} {value.name!r} has no shape (unknown rank)")
    return TensorSpec(value.name, SUPPORTED_DTYPES[elem_type], _dims(value))


def read_signature(model: onnx.ModelProto) -> Signature:
    initializers = {init.name for init in model.graph.initializer}
    inputs = tuple(_spec(v, "input") for v in model.graph.input if v.name not in initializers)
    outputs = tuple(_spec(v, "output") for v in model.graph.output)
    if not inputs:
        raise InvalidModelError("model has no inputs (besides initializers)")
    if not outputs:
        raise InvalidModelError("model has no outputs")
    return Signature(inputs, outputs)


def fix_input_shapes(model: onnx.ModelProto, bucket: dict[str, tuple]) -> onnx.ModelProto:
    """The bucket's sizes as the inputs' dims; a named dim stays symbolic under that one name."""
    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    for value in fixed.graph.input:
        if value.name in bucket:
            for dim, size in zip(value.type.tensor_type.shape.dim, bucket[value.name], strict=True):
                dim.Clear()
                if isinstance(size, str):
                    dim.dim_param = size
                else:
                    dim.dim_value = int(size)
    return fixed
