"""Uploads no server should accept: a corpus of broken, hostile and impossible ONNX models and archives.

Each entry is ``name -> upload body``; every one must be refused with a 4xx that names the problem,
leaving the server alive and nothing stored. Built from the valid models of :mod:`tests.synthetic`,
broken one way each.
"""

from __future__ import annotations

import io
import tarfile
import zipfile

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests import synthetic
from tests.synthetic import make_model, value


def _edited(data: bytes, edit) -> bytes:
    model = onnx.load_from_string(data)
    edit(model)
    return model.SerializeToString()


def _graph_model(nodes, inputs, outputs, initializer=(), *, opset: int = synthetic.OPSET) -> bytes:
    graph = helper.make_graph(nodes, "broken", inputs, outputs, initializer=list(initializer))
    return make_model(graph, opset=opset, check=False).SerializeToString()


def _external_in_if_branch(location: str) -> bytes:
    """External data hidden inside a subgraph, where a check of the main graph's initializers misses it."""
    weight = onnx.TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[4])
    weight.data_location = TensorProto.EXTERNAL
    for key, text in (("location", location), ("offset", "0"), ("length", "16")):
        weight.external_data.add(key=key, value=text)
    branch = helper.make_graph(
        [helper.make_node("Add", ["x", "W"], ["z"])], "branch", [], [value("z", "float32", ["batch", 4])], [weight]
    )
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["w"])], "other", [], [value("w", "float32", [])])
    node = helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=other)
    return _graph_model(
        [node], [value("cond", "bool", []), value("x", "float32", ["batch", 4])], [value("y", "float32", ["batch", 4])]
    )


def _archive(kind: str, members: dict[str, bytes], *, symlink: tuple[str, str] | None = None) -> bytes:
    buffer = io.BytesIO()
    if kind == "zip":
        with zipfile.ZipFile(buffer, "w") as archive:
            for name, data in members.items():
                archive.writestr(name, data)
        return buffer.getvalue()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
        if symlink:
            info = tarfile.TarInfo(symlink[0])
            info.type, info.linkname = tarfile.SYMTYPE, symlink[1]
            archive.addfile(info)
    return buffer.getvalue()


def _raw_data_short(model: onnx.ModelProto) -> None:
    weight = model.graph.initializer[0]
    weight.ClearField("float_data")
    weight.raw_data = b"\x00" * 4  # dims say 64 floats


def corpus() -> dict[str, bytes]:
    add = synthetic.add_model()
    two = synthetic.two_input_model()
    x, y = value("x", "float32", ["batch", 4]), value("y", "float32", ["batch", 4])
    rng = np.random.default_rng(7)
    return {
        "garbage": b"this is not an ONNX model at all",
        "empty": b"",
        "random-bytes": rng.bytes(4096),
        "truncated-half": two[: len(two) // 2],
        "truncated-one-byte": two[:-1],
        "zeros": b"\x00" * 1024,
        "external-data-relative": synthetic.external_data_model("../../etc/passwd"),
        "external-data-absolute": synthetic.external_data_model("/etc/passwd"),
        "external-data-missing": synthetic.external_data_model("weights.bin"),
        "external-data-in-if-branch": _external_in_if_branch("../../etc/passwd"),
        "unknown-op": synthetic.unsupported_op_model().replace(b"Det", b"Dxt"),
        "unknown-domain": _edited(add, lambda m: setattr(m.graph.node[0], "domain", "com.evil")),
        "opset-99": _graph_model([helper.make_node("Add", ["x", "x"], ["y"])], [x], [y], opset=99),
        "ir-version-99": _edited(add, lambda m: setattr(m, "ir_version", 99)),
        "no-outputs": _graph_model([helper.make_node("Add", ["x", "x"], ["y"])], [x], []),
        "undefined-tensor": _graph_model([helper.make_node("Add", ["x", "ghost"], ["y"])], [x], [y]),
        "cycle": _graph_model(
            [
                helper.make_node("Add", ["x", "b"], ["a"]),
                helper.make_node("Relu", ["a"], ["b"]),
                helper.make_node("Identity", ["a"], ["y"]),
            ],
            [x],
            [y],
        ),
        "tensor-written-twice": _graph_model(
            [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Neg", ["x"], ["y"])], [x], [y]
        ),
        "output-never-written": _graph_model([helper.make_node("Relu", ["x"], ["z"])], [x], [y]),
        "input-without-type": _edited(add, lambda m: m.graph.input[0].ClearField("type")),
        "wrong-arity": _graph_model([helper.make_node("Add", ["x"], ["y"])], [x], [y]),
        "weights-shorter-than-dims": _edited(two, _raw_data_short),
        "weight-dims-negative": _edited(two, lambda m: m.graph.initializer[0].dims.__setitem__(0, -8)),
        "static-dim-1e12": synthetic.relu_model([10**12, 4]),
        "constant-of-shape-4tb": synthetic.constant_of_shape_model([2**20, 2**20]),
        "invalid-utf8-op-type": add.replace(b"Add", b"\xff\xfe\xfd"),
        "data-type-99": _edited(two, lambda m: setattr(m.graph.initializer[0], "data_type", 99)),
        "string-initializer-as-float": _edited(
            two,
            lambda m: m.graph.initializer[0].CopyFrom(
                numpy_helper.from_array(np.array(["a"] * 64), m.graph.initializer[0].name)
            ),
        ),
        "zip-without-model": _archive("zip", {"notes.txt": b"hello"}),
        "zip-escaping-its-folder": _archive("zip", {"../../evil.onnx": add}),
        "tar-absolute-member": _archive("tar", {"/tmp/evil.onnx": add}),
        "tar-symlink-data": _archive(
            "tar", {"model.onnx": synthetic.external_data_model("w.bin")}, symlink=("w.bin", "/etc/passwd")
        ),
        "zip-truncated": _archive("zip", {"model.onnx": add})[:-10],
    }
