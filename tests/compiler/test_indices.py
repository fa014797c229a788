"""Which integer inputs index a tensor, and the range a request is checked against."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from compiler.models.indices import index_bounds
from tests import synthetic
from tests.synthetic import make_model, value


def graph_bounds(nodes, inputs, outputs, initializers=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    return index_bounds(make_model(graph, check=False))


def table(name: str, rows: int, cols: int = 4):
    return numpy_helper.from_array(np.zeros((rows, cols), np.float32), name)


def test_embedding_gather_is_bounded_by_the_table():
    bounds = index_bounds(onnx.load_from_string(synthetic.embedding_model(vocab=50)))
    assert bounds.ranges == {"ids": (-50, 49, "Gather 'embedding'")}
    assert bounds.unchecked == []


def test_computed_index_cannot_be_checked():
    bounds = index_bounds(onnx.load_from_string(synthetic.embedding_model(computed_index=True)))
    assert bounds.ranges == {}
    assert [use.input for use in bounds.unchecked] == ["ids"]
    assert "no bound" in bounds.unchecked[0].describe()


def test_values_moved_by_reshape_and_cast_keep_their_bound_and_the_tightest_wins():
    bounds = graph_bounds(
        [
            helper.make_node("Cast", ["ids"], ["ids32"], to=onnx.TensorProto.INT32),
            helper.make_node("Unsqueeze", ["ids32", "axes"], ["ids3"]),
            helper.make_node("Gather", ["big", "ids3"], ["a"], name="big"),
            helper.make_node("Gather", ["small", "ids"], ["b"], name="small", axis=1),
        ],
        [value("ids", "int64", ["batch", 3])],
        [value("a", "float32", ["batch", 1, 3, 4]), value("b", "float32", [7, "batch", 3])],
        [table("big", 100), table("small", 7, 20), numpy_helper.from_array(np.array([1], np.int64), "axes")],
    )
    assert bounds.ranges == {"ids": (-20, 19, "Gather 'small'")}


def test_gather_on_the_input_itself_and_shape_uses_are_not_indices():
    bounds = graph_bounds(
        [
            helper.make_node("Shape", ["ids"], ["shape"]),
            helper.make_node("Gather", ["shape", "zero"], ["batch"]),
            helper.make_node("Gather", ["ids", "zero"], ["first"]),  # ids is the data here
        ],
        [value("ids", "int64", [4, 3])],
        [value("batch", "int64", []), value("first", "int64", [3])],
        [numpy_helper.from_array(np.array(0, np.int64), "zero")],
    )
    assert bounds.uses == ()


def test_float_inputs_are_not_followed_and_gather_nd_is_unchecked():
    bounds = graph_bounds(
        [
            helper.make_node("Cast", ["x"], ["xi"], to=onnx.TensorProto.INT64),
            helper.make_node("Gather", ["t", "xi"], ["a"]),
            helper.make_node("GatherND", ["t", "ids"], ["b"]),
        ],
        [value("x", "float32", [2]), value("ids", "int64", [2, 2])],
        [value("a", "float32", [2, 4]), value("b", "float32", [2])],
        [table("t", 10)],
    )
    assert bounds.ranges == {}
    assert [(u.input, u.node) for u in bounds.unchecked] == [("ids", "GatherND")]


def test_a_value_both_moved_and_computed_counts_as_computed():
    bounds = graph_bounds(
        [
            helper.make_node("Add", ["ids", "one"], ["plus"]),
            helper.make_node("Concat", ["ids", "plus"], ["both"], axis=0),
            helper.make_node("Gather", ["t", "both"], ["a"]),
        ],
        [value("ids", "int64", [2])],
        [value("a", "float32", [4, 4])],
        [table("t", 10), numpy_helper.from_array(np.array(1, np.int64), "one")],
    )
    assert bounds.ranges == {"ids": (-10, 9, "Gather")}  # still checked where it indexes as sent
    assert [use.input for use in bounds.unchecked] == ["ids"]  # and never served by a kernel


def test_an_input_captured_by_a_subgraph_is_unchecked():
    then_branch = helper.make_graph(
        [helper.make_node("Gather", ["t", "ids"], ["out"])], "then", [], [value("out", "float32", [2, 4])]
    )
    else_branch = helper.make_graph(
        [helper.make_node("Identity", ["fallback"], ["out"])], "else", [], [value("out", "float32", [2, 4])]
    )
    bounds = graph_bounds(
        [helper.make_node("If", ["cond"], ["y"], then_branch=then_branch, else_branch=else_branch)],
        [value("ids", "int64", [2]), value("cond", "bool", [])],
        [value("y", "float32", [2, 4])],
        [table("t", 10), numpy_helper.from_array(np.zeros((2, 4), np.float32), "fallback")],
    )
    assert [use.node for use in bounds.unchecked] == ["a subgraph (If/Loop/Scan)"]


def test_seeded_inputs_stay_inside_a_small_table():
    from compiler.running.arrays import random_inputs

    bounds = index_bounds(onnx.load_from_string(synthetic.embedding_model(vocab=3)))
    assert bounds.limits == {"ids": 3}
    inputs = random_inputs({"ids": (64, 8)}, {"ids": "int64"}, 0, bounds.limits)
    assert inputs["ids"].max() == 2 and inputs["ids"].min() == 0
