"""Small, deterministic ONNX models for tests that need no TVM compile.

Every builder returns the serialized model (``bytes``). All but
:func:`external_data_model` pass ``onnx.checker.check_model(full_check=True)``
and load in onnxruntime (opset 17, IR version 8).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8

_ELEM_TYPES = {
    "float32": TensorProto.FLOAT,
    "float16": TensorProto.FLOAT16,
    "float64": TensorProto.DOUBLE,
    "int32": TensorProto.INT32,
    "int64": TensorProto.INT64,
    "bool": TensorProto.BOOL,
    "string": TensorProto.STRING,
}

Dims = Sequence[int | str | None]


def make_model(graph: onnx.GraphProto, *, opset: int = OPSET, check: bool = True) -> onnx.ModelProto:
    """Wrap a graph at the test opset and IR version; full-check it unless told not to."""
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="jitserve-tests")
    model.ir_version = IR_VERSION
    if check:
        onnx.checker.check_model(model, full_check=True)
    return model


def value(name: str, dtype: str, dims: Dims) -> onnx.ValueInfoProto:
    """A tensor value info; ``None`` in ``dims`` is a dim with neither dim_value nor dim_param."""
    return helper.make_tensor_value_info(name, _ELEM_TYPES[dtype], list(dims))


def add_model(dtype: str = "float32") -> bytes:
    """``y = x + x`` over ``x: [batch, 4]`` for float32, float16 or int64."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "x"], ["y"])],
        f"add_{dtype}",
        [value("x", dtype, ["batch", 4])],
        [value("y", dtype, ["batch", 4])],
    )
    return make_model(graph).SerializeToString()


def two_input_model() -> bytes:
    """``y = MatMul(a, W) + b`` with ``a, b: [batch, 8]`` float32 sharing the axis ``batch``."""
    rng = np.random.default_rng(1234)
    weight = rng.standard_normal((8, 8)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["a", "W"], ["aw"]),
            helper.make_node("Add", ["aw", "b"], ["y"]),
        ],
        "two_input",
        [value("a", "float32", ["batch", 8]), value("b", "float32", ["batch", 8])],
        [value("y", "float32", ["batch", 8])],
        initializer=[numpy_helper.from_array(weight, "W")],
    )
    return make_model(graph).SerializeToString()


def relu_model(dims: Dims, name: str = "x") -> bytes:
    """``y = Relu(x)`` with the given input dims (``None`` = unnamed dynamic dim)."""
    graph = helper.make_graph(
        [helper.make_node("Relu", [name], ["y"])],
        "relu",
        [value(name, "float32", dims)],
        [value("y", "float32", [d if isinstance(d, int) else None for d in dims])],
    )
    return make_model(graph).SerializeToString()


def unnamed_axis_model() -> bytes:
    """``y = Relu(x)`` with ``x: [<unnamed>, 6]``."""
    return relu_model([None, 6])


def unsupported_op_model() -> bytes:
    """``Det`` over ``x: [2, 3, 3]``: valid ONNX that onnxruntime runs and TVM's Relax importer lacks."""
    graph = helper.make_graph(
        [helper.make_node("Det", ["x"], ["y"])],
        "det",
        [value("x", "float32", [2, 3, 3])],
        [value("y", "float32", [2])],
    )
    return make_model(graph).SerializeToString()


def batch_mix_model() -> bytes:
    """``y = x - ReduceMean(x, axes=[0])`` over ``x: [batch, 4]``: padded rows change the mean."""
    graph = helper.make_graph(
        [
            helper.make_node("ReduceMean", ["x"], ["mean"], axes=[0], keepdims=1),
            helper.make_node("Sub", ["x", "mean"], ["y"]),
        ],
        "batch_mix",
        [value("x", "float32", ["batch", 4])],
        [value("y", "float32", ["batch", 4])],
    )
    return make_model(graph).SerializeToString()


def external_data_model(location: str = "../../etc/passwd") -> bytes:
    """``y = x + W`` where ``W`` points at external data; deliberately not checked."""
    weight = onnx.TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[4])
    weight.data_location = TensorProto.EXTERNAL
    for key, text in (("location", location), ("offset", "0"), ("length", "16")):
        weight.external_data.add(key=key, value=text)
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "W"], ["y"])],
        "external_data",
        [value("x", "float32", ["batch", 4])],
        [value("y", "float32", ["batch", 4])],
        initializer=[weight],
    )
    return make_model(graph, check=False).SerializeToString()


def slow_model(layers: int = 32, width: int = 1024, *, compilable: bool = False) -> bytes:
    """``x: [batch, 4]`` through ``layers`` of ``Tanh(h @ W)`` with ``W: [width, width]``: slow in onnxruntime.

    About 0.35 s per request at batch 1024 on two cores (layers=32). Unless
    ``compilable``, a second output ``det = Det(Reshape(x, [-1, 2, 2]))`` is an
    operator TVM's importer lacks, so a compile of any bucket fails fast and
    onnxruntime keeps serving at its own speed; one weight shared by every
    layer keeps the file ~4 MB.
    """
    rng = np.random.default_rng(4321)
    weights = {
        "W_in": rng.standard_normal((4, width)) / 2,
        "W": rng.standard_normal((width, width)) / np.sqrt(width),
        "W_out": rng.standard_normal((width, 4)) / np.sqrt(width),
        "square": np.array([-1, 2, 2]),
    }
    nodes = [helper.make_node("MatMul", ["x", "W_in"], ["h0"])]
    for i in range(layers):
        nodes.append(helper.make_node("MatMul", [f"h{i}", "W"], [f"m{i}"]))
        nodes.append(helper.make_node("Tanh", [f"m{i}"], [f"h{i + 1}"]))
    nodes.append(helper.make_node("MatMul", [f"h{layers}", "W_out"], ["y"]))
    outputs = [value("y", "float32", ["batch", 4])]
    if not compilable:
        nodes.append(helper.make_node("Reshape", ["x", "square"], ["x2x2"]))
        nodes.append(helper.make_node("Det", ["x2x2"], ["det"]))
        outputs.append(value("det", "float32", ["batch"]))
    else:
        del weights["square"]
    graph = helper.make_graph(
        nodes,
        "slow",
        [value("x", "float32", ["batch", 4])],
        outputs,
        initializer=[
            numpy_helper.from_array(array.astype(np.int64 if key == "square" else np.float32), key)
            for key, array in weights.items()
        ],
    )
    return make_model(graph).SerializeToString()


class _Graph:
    """A synthetic model's nodes and seeded weights, added one call at a time; each call returns the name of
    what it made."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.inits: list[onnx.TensorProto] = []
        self.nodes: list[onnx.NodeProto] = []

    def const(self, name: str, array) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def weight(self, name: str, shape: tuple[int, ...], scale: float) -> str:
        return self.const(name, (self.rng.standard_normal(shape) * scale).astype(np.float32))

    def node(self, op: str, inputs: list[str], output: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op, inputs, [output], **attrs))
        return output

    def linear(self, src: str, name: str, n_in: int, n_out: int) -> str:
        w = self.weight(f"{name}_w", (n_in, n_out), 1.0 / np.sqrt(n_in))
        b = self.weight(f"{name}_b", (n_out,), 0.02)
        return self.node("Add", [self.node("MatMul", [src, w], f"{name}_mm"), b], name)

    def heads(self, src: str, perm: list[int]) -> str:
        """``src`` reshaped by the graph's ``heads_shape`` and transposed by ``perm``."""
        return self.node("Transpose", [self.node("Reshape", [src, "heads_shape"], f"{src}_r")], f"{src}_t", perm=perm)

    def layer_norm(self, src: str, name: str, hidden: int) -> str:
        gamma = self.const(f"{name}_g", (1.0 + self.rng.standard_normal(hidden) * 0.1).astype(np.float32))
        beta = self.weight(f"{name}_b", (hidden,), 0.1)
        return self.node("LayerNormalization", [src, gamma, beta], name, axis=-1)


def bert_encoder_model(layers: int = 2, hidden: int = 256, heads: int = 4, seq: int = 128) -> bytes:
    """A BERT-style encoder without embeddings over ``x: [batch, seq, hidden]`` float32.

    Each layer: Q/K/V projections (MatMul + Add bias), Q scaled by
    ``1/sqrt(head_dim)``, reshape/transpose to ``heads``, scores (MatMul),
    Softmax, MatMul with V, output projection, residual Add,
    LayerNormalization, then the FFN ``MatMul -> GELU (Erf form) -> MatMul``
    with a residual and a second LayerNormalization. Deterministic weights
    (seed 2024).

    Q is scaled before the scores rather than the scores after: onnxsim 0.8
    fuses ``Softmax(Q @ K / s)`` into a ``com.microsoft.Attention`` node with
    a ``scale`` attribute, which TVM's ONNX importer rejects.
    """
    if hidden % heads:
        raise ValueError("hidden must be a multiple of heads")
    head_dim = hidden // heads
    graph = _Graph(2024)
    const, node, linear, split_heads = graph.const, graph.node, graph.linear, graph.heads

    def layer_norm(src: str, name: str) -> str:
        return graph.layer_norm(src, name, hidden)

    const("heads_shape", np.array([0, seq, heads, head_dim], dtype=np.int64))
    const("merge_shape", np.array([0, seq, hidden], dtype=np.int64))
    const("scale", np.array(np.sqrt(head_dim), dtype=np.float32))
    const("sqrt2", np.array(np.sqrt(2.0), dtype=np.float32))
    const("one", np.array(1.0, dtype=np.float32))
    const("half", np.array(0.5, dtype=np.float32))

    h = "x"
    for i in range(layers):
        p = f"l{i}_"
        q = split_heads(node("Div", [linear(h, f"{p}q", hidden, hidden), "scale"], f"{p}q_scaled"), [0, 2, 1, 3])
        k = split_heads(linear(h, f"{p}k", hidden, hidden), [0, 2, 3, 1])  # [b, heads, d, seq]
        v = split_heads(linear(h, f"{p}v", hidden, hidden), [0, 2, 1, 3])  # [b, heads, seq, d]
        probs = node("Softmax", [node("MatMul", [q, k], f"{p}scores")], f"{p}probs", axis=-1)
        ctx = node("Transpose", [node("MatMul", [probs, v], f"{p}ctx_h")], f"{p}ctx_t", perm=[0, 2, 1, 3])
        ctx = node("Reshape", [ctx, "merge_shape"], f"{p}ctx")
        h1 = layer_norm(node("Add", [h, linear(ctx, f"{p}o", hidden, hidden)], f"{p}res1"), f"{p}ln1")
        up = linear(h1, f"{p}up", hidden, 4 * hidden)
        erf = node("Erf", [node("Div", [up, "sqrt2"], f"{p}gx")], f"{p}gerf")
        gelu = node("Mul", [node("Mul", [up, node("Add", [erf, "one"], f"{p}gplus")], f"{p}gmul"), "half"], f"{p}gelu")
        down = linear(gelu, f"{p}down", 4 * hidden, hidden)
        h = layer_norm(node("Add", [h1, down], f"{p}res2"), f"{p}ln2")

    node("Identity", [h], "y")
    graph = helper.make_graph(
        graph.nodes,
        "bert_encoder",
        [value("x", "float32", ["batch", seq, hidden])],
        [value("y", "float32", ["batch", seq, hidden])],
        initializer=graph.inits,
    )
    return make_model(graph).SerializeToString()


def _attended(graph: _Graph, h: str, qkv: tuple[str, str, str], blocked: str, *, p: str, hidden: int) -> str:
    """``h`` plus its attention's output projection: Q @ K (K transposed) scaled, the ``blocked`` keys at
    float32's lowest, Softmax, @ V, the heads merged."""
    node, (q, k_t, v) = graph.node, qkv
    scores = node("Div", [node("MatMul", [q, k_t], f"{p}qk"), "scale"], f"{p}scores")
    probs = node("Softmax", [node("Where", [blocked, "lowest", scores], f"{p}masked")], f"{p}probs", axis=-1)
    ctx = node("Transpose", [node("MatMul", [probs, v], f"{p}ctx_h")], f"{p}ctx_t", perm=[0, 2, 1, 3])
    merged = node("Reshape", [ctx, "merge_shape"], f"{p}ctx")
    return node("Add", [h, graph.linear(merged, f"{p}o", hidden, hidden)], f"{p}r1")


def _decoder_graph(seed: int, hidden: int, heads: int) -> tuple[_Graph, int]:
    """A GPT-2-style decoder's graph with the constants its layers read, and its heads' width."""
    if hidden % heads:
        raise ValueError("hidden must be a multiple of heads")
    head_dim = hidden // heads
    graph = _Graph(seed)
    const = graph.const
    const("heads_shape", np.array([0, -1, heads, head_dim], dtype=np.int64))
    const("merge_shape", np.array([0, -1, hidden], dtype=np.int64))
    const("scale", np.array(np.sqrt(head_dim), dtype=np.float32))
    const("lowest", np.array(np.finfo(np.float32).min, dtype=np.float32))
    const("zero", np.array(0, dtype=np.int64))
    const("one", np.array(1, dtype=np.int64))
    const("axis0", np.array([0], dtype=np.int64))
    const("axis1", np.array([1], dtype=np.int64))
    return graph, head_dim


def causal_decoder_model(layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 97) -> bytes:
    """A GPT-2-style decoder over ``ids: [batch, seq]`` int64 (``seq`` symbolic) to ``logits: [batch, seq,
    vocab]``, built as exporters write one: token and position embeddings (Gather, the positions a CumSum
    over ones, as Hugging Face counts them), pre-norm layers whose causal mask is computed from the
    sequence's length (Range, Greater, Where with float32's lowest value), the scores scaled after
    Q @ K, Softmax, GELU in its tanh form, a final LayerNormalization and a head of ``vocab`` columns
    (97: no whole number of vectors). Deterministic weights (seed 2025)."""
    graph, _ = _decoder_graph(2025, hidden, heads)
    const, weight, node, linear, heads_of = graph.const, graph.weight, graph.node, graph.linear, graph.heads

    def layer_norm(src: str, name: str) -> str:
        return graph.layer_norm(src, name, hidden)

    for name, value_ in {"c_half": 0.5, "c_one": 1.0, "c_cube": 0.044715, "c_root": np.sqrt(2 / np.pi)}.items():
        const(name, np.array(value_, dtype=np.float32))
    # The sequence's length, its positions and the causal mask, computed at run time as exports do.
    shape = node("Shape", ["ids"], "ids_shape")
    steps = node("Range", ["zero", node("Gather", [shape, "one"], "length", axis=0), "one"], "steps")
    future = node(
        "Greater",
        [node("Unsqueeze", [steps, "axis0"], "key_pos"), node("Unsqueeze", [steps, "axis1"], "query_pos")],
        "future",
    )
    # Position ids as Hugging Face counts them from a mask of ones: a cumulative sum, less one.
    ones = node("ConstantOfShape", [shape], "ones", value=numpy_helper.from_array(np.array([1], dtype=np.int64)))
    positions = node("Sub", [node("CumSum", [ones, "one"], "counted"), "one"], "positions")
    h = node(
        "Add",
        [
            node("Gather", [weight("wte", (vocab, hidden), 0.5), "ids"], "tokens"),
            node("Gather", [weight("wpe", (64, hidden), 0.1), positions], "places"),
        ],
        "embedded",
    )
    for i in range(layers):
        p = f"l{i}_"
        x = layer_norm(h, f"{p}ln1")
        q = heads_of(linear(x, f"{p}q", hidden, hidden), [0, 2, 1, 3])
        k = heads_of(linear(x, f"{p}k", hidden, hidden), [0, 2, 3, 1])
        v = heads_of(linear(x, f"{p}v", hidden, hidden), [0, 2, 1, 3])
        h = _attended(graph, h, (q, k, v), future, p=p, hidden=hidden)
        up = linear(layer_norm(h, f"{p}ln2"), f"{p}up", hidden, 4 * hidden)
        cube = node("Mul", [node("Mul", [node("Mul", [up, up], f"{p}sq"), up], f"{p}cu"), "c_cube"], f"{p}cubed")
        inner = node("Mul", [node("Add", [up, cube], f"{p}poly"), "c_root"], f"{p}inner")
        gate = node("Mul", [node("Add", [node("Tanh", [inner], f"{p}tanh"), "c_one"], f"{p}plus"), "c_half"], f"{p}g")
        h = node("Add", [h, linear(node("Mul", [up, gate], f"{p}gelu"), f"{p}down", 4 * hidden, hidden)], f"{p}r2")
    head = weight("head", (hidden, vocab), 1.0 / np.sqrt(hidden))
    node("MatMul", [layer_norm(h, "ln_f"), head], "logits")
    graph = helper.make_graph(
        graph.nodes,
        "causal_decoder",
        [value("ids", "int64", ["batch", "seq"])],
        [value("logits", "float32", ["batch", "seq", vocab])],
        initializer=graph.inits,
    )
    return make_model(graph).SerializeToString()


def kv_cache_decoder_model(
    layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 97, positions: int = 64, *, masked: bool = True
) -> bytes:
    """A GPT-2-style decoder with its key/value cache as inputs and outputs, as ``optimum`` exports one:
    ``input_ids`` [batch, new], ``attention_mask`` [batch, past + new], ``position_ids`` [batch, new] and
    ``past_key_values.{i}.key`` / ``.value`` [batch, heads, past, head_dim] in; ``logits`` [batch, new,
    vocab] and ``present.{i}.key`` / ``.value`` (the past with the new positions appended) out. A key is
    attended where it is not in the future of the query (``past + query``) and the mask holds 1 for it.
    ``positions`` rows of learned position embeddings. ``masked=False``: no ``attention_mask`` or
    ``position_ids`` inputs (the positions follow the past's length), as some exports have it. Deterministic
    weights (seed 2026)."""
    graph, head_dim = _decoder_graph(2026, hidden, heads)
    const, weight, node, linear, heads_of = graph.const, graph.weight, graph.node, graph.linear, graph.heads

    def layer_norm(src: str, name: str) -> str:
        return graph.layer_norm(src, name, hidden)

    const("two", np.array(2, dtype=np.int64))
    const("axes12", np.array([1, 2], dtype=np.int64))
    const("c_half", np.array(0.5, dtype=np.float32))
    const("c_one", np.array(1.0, dtype=np.float32))
    # Past and total lengths; a key is blocked where it lies after the query or the mask holds 0 for it.
    past_length = node("Gather", [node("Shape", ["past_key_values.0.key"], "past_shape"), "two"], "past_len", axis=0)
    new_length = node("Gather", [node("Shape", ["input_ids"], "ids_shape"), "one"], "new_len", axis=0)
    total = node("Add", [past_length, new_length], "total_len")
    key_pos = node("Unsqueeze", [node("Range", ["zero", total, "one"], "keys"), "axis0"], "key_pos")
    query_pos = node("Unsqueeze", [node("Range", [past_length, total, "one"], "queries"), "axis1"], "query_pos")
    future = node("Greater", [key_pos, query_pos], "future")
    if masked:
        padding = node("Equal", ["attention_mask", node("Sub", ["one", "one"], "nought")], "pad")
        blocked = node("Or", [future, node("Unsqueeze", [padding, "axes12"], "pad_4d")], "blocked")
        position_ids = "position_ids"
    else:  # the positions follow the past
        blocked = future
        position_ids = node("Unsqueeze", [node("Range", [past_length, total, "one"], "steps"), "axis0"], "positions")
    h = node(
        "Add",
        [
            node("Gather", [weight("wte", (vocab, hidden), 0.5), "input_ids"], "tokens"),
            node("Gather", [weight("wpe", (positions, hidden), 0.1), position_ids], "places"),
        ],
        "embedded",
    )
    inputs = [value("input_ids", "int64", ["batch", "new"])]
    if masked:
        inputs += [
            value("attention_mask", "int64", ["batch", "total"]),
            value("position_ids", "int64", ["batch", "new"]),
        ]
    outputs = [value("logits", "float32", ["batch", "new", vocab])]
    for i in range(layers):
        p = f"l{i}_"
        x = layer_norm(h, f"{p}ln1")
        q = heads_of(linear(x, f"{p}q", hidden, hidden), [0, 2, 1, 3])
        keys = node("Concat", [f"past_key_values.{i}.key", heads_of(linear(x, f"{p}k", hidden, hidden), [0, 2, 1, 3])],
                    f"present.{i}.key", axis=2)  # fmt: skip
        values = node(
            "Concat", [f"past_key_values.{i}.value", heads_of(linear(x, f"{p}v", hidden, hidden), [0, 2, 1, 3])],
            f"present.{i}.value", axis=2,
        )  # fmt: skip
        for kind in ("key", "value"):
            inputs.append(value(f"past_key_values.{i}.{kind}", "float32", ["batch", heads, "past", head_dim]))
            outputs.append(value(f"present.{i}.{kind}", "float32", ["batch", heads, "total", head_dim]))
        k_t = node("Transpose", [keys], f"{p}keys_t", perm=[0, 1, 3, 2])
        h = _attended(graph, h, (q, k_t, values), blocked, p=p, hidden=hidden)
        up = linear(layer_norm(h, f"{p}ln2"), f"{p}up", hidden, 4 * hidden)
        gate = node("Mul", [node("Add", [node("Tanh", [up], f"{p}tanh"), "c_one"], f"{p}plus"), "c_half"], f"{p}g")
        h = node("Add", [h, linear(node("Mul", [up, gate], f"{p}act"), f"{p}down", 4 * hidden, hidden)], f"{p}r2")
    head = weight("head", (hidden, vocab), 4.0 / np.sqrt(hidden))
    node("MatMul", [layer_norm(h, "ln_f"), head], "logits")
    graph = helper.make_graph(graph.nodes, "kv_cache_decoder", inputs, outputs, initializer=graph.inits)
    return make_model(graph).SerializeToString()


def embedding_model(vocab: int = 50, dim: int = 8, *, computed_index: bool = False) -> bytes:
    """``y = ReduceMean(Gather(table, ids), axis=1)`` over ``ids: [batch, seq]`` int64: a text
    encoder's embedding. With ``computed_index`` the table is indexed by ``ids + 1``, a value no
    request can be range-checked by (jitserve then never serves it with a kernel)."""
    rng = np.random.default_rng(99)
    table = numpy_helper.from_array(rng.standard_normal((vocab, dim)).astype(np.float32), "table")
    one = numpy_helper.from_array(np.array(1, dtype=np.int64), "one")
    nodes = [helper.make_node("Add", ["ids", "one"], ["shifted"])] if computed_index else []
    nodes += [
        helper.make_node("Gather", ["table", "shifted" if computed_index else "ids"], ["emb"], name="embedding"),
        helper.make_node("ReduceMean", ["emb"], ["y"], axes=[1], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "embedding",
        [value("ids", "int64", ["batch", "seq"])],
        [value("y", "float32", ["batch", dim])],
        initializer=[table, one] if computed_index else [table],
    )
    return make_model(graph).SerializeToString()


def scalar_input_model(pad: int = 64) -> bytes:
    """An audio front end with a rank-0 input: ``x: [batch, samples]`` float32 and ``sr: []`` int64.

    ``y = ReflectPad(x, pad samples each side) * sr / 16000`` and ``gain = sr / 16000`` (a rank-0
    output). The reflect pad needs more than ``pad`` samples, so short probe sizes fail.
    """
    nodes = [
        helper.make_node("Pad", ["x", "pads"], ["padded"], mode="reflect"),
        helper.make_node("Cast", ["sr"], ["sr_f"], to=TensorProto.FLOAT),
        helper.make_node("Div", ["sr_f", "base"], ["gain"]),
        helper.make_node("Mul", ["padded", "gain"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "scalar_input",
        [value("x", "float32", ["batch", "samples"]), value("sr", "int64", [])],
        [value("y", "float32", ["batch", "samples_padded"]), value("gain", "float32", [])],
        initializer=[
            numpy_helper.from_array(np.array([0, pad, 0, pad], dtype=np.int64), "pads"),
            numpy_helper.from_array(np.array(16000, dtype=np.float32), "base"),
        ],
    )
    return make_model(graph).SerializeToString()


def gather_rows_model(rows: int = 10, dim: int = 4) -> bytes:
    """``y = GatherND(table, idx)`` over ``idx: [batch, 1]`` int64: rows of a table. GatherND's
    indices have no bound jitserve checks, so only ONNX Runtime tells an index out of range."""
    rng = np.random.default_rng(7)
    table = numpy_helper.from_array(rng.standard_normal((rows, dim)).astype(np.float32), "table")
    graph = helper.make_graph(
        [helper.make_node("GatherND", ["table", "idx"], ["y"])],
        "gather_rows",
        [value("idx", "int64", ["batch", 1])],
        [value("y", "float32", ["batch", dim])],
        initializer=[table],
    )
    return make_model(graph).SerializeToString()


def mean_mix_model(weight: float = 0.01) -> bytes:
    """``y = x + weight * mean(x over W)`` on x[1, 8, W]: zero padding along W shifts the mean, so it
    changes every output by a little (an axis for the ``approximate`` policy)."""
    nodes = [
        helper.make_node("ReduceMean", ["x"], ["mean"], axes=[2], keepdims=1),
        helper.make_node("Mul", ["mean", "weight"], ["scaled"]),
        helper.make_node("Add", ["x", "scaled"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "mean_mix",
        [value("x", "float32", [1, 8, "W"])],
        [value("y", "float32", [1, 8, "W"])],
        initializer=[numpy_helper.from_array(np.array(weight, dtype=np.float32), "weight")],
    )
    return make_model(graph).SerializeToString()


def conv_model(channels: int = 16, size: int = 96) -> bytes:
    """A padded 3x3 conv and a Relu on x[N, 3, size, size]: a detector's first layer."""
    weight = np.random.default_rng(5).standard_normal((channels, 3, 3, 3)).astype(np.float32) * 0.2
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "conv",
        [value("x", "float32", ["N", 3, size, size])],
        [value("y", "float32", ["N", channels, size, size])],
        initializer=[numpy_helper.from_array(weight, "w")],
    )
    return make_model(graph).SerializeToString()


def constant_of_shape_model(shape: Sequence[int]) -> bytes:
    """``y = x + ConstantOfShape(shape)`` over ``x: [batch, shape[-1]]``: the constant's size is static."""
    graph = helper.make_graph(
        [
            helper.make_node("ConstantOfShape", ["shape"], ["filled"]),
            helper.make_node("Add", ["x", "filled"], ["y"]),
        ],
        "constant_of_shape",
        [value("x", "float32", ["batch", shape[-1]])],
        [value("y", "float32", [None] * len(shape))],
        initializer=[numpy_helper.from_array(np.asarray(shape, dtype=np.int64), "shape")],
    )
    return make_model(graph).SerializeToString()


def many_inputs_model(count: int) -> bytes:
    """``y = x0 + x1 + ...`` over ``count`` inputs of shape ``[<unnamed>, 2]``: ``count`` symbolic axes."""
    names = [f"x{i}" for i in range(count)]
    graph = helper.make_graph(
        [helper.make_node("Sum", names, ["y"])],
        "many_inputs",
        [value(name, "float32", [None, 2]) for name in names],
        [value("y", "float32", [None, 2])],
    )
    return make_model(graph).SerializeToString()


def reweighted(data: bytes, seed: int) -> bytes:
    """The same architecture with new weights (a retrained model): every weight of the model (float
    initializer or Constant of 64+ elements) drawn anew, every other tensor kept."""
    from compiler.models.weights import constant_value, is_weight

    model = onnx.load_from_string(data)
    rng = np.random.default_rng(seed)
    tensors = [*model.graph.initializer, *(t for n in model.graph.node if (t := constant_value(n)) is not None)]
    for tensor in tensors:
        if is_weight(tensor):
            array = numpy_helper.to_array(tensor)
            noise = rng.standard_normal(array.shape) * 0.05 * (np.abs(array).mean() + 1e-3)
            fresh = (array + noise).astype(array.dtype)
            tensor.CopyFrom(numpy_helper.from_array(fresh, tensor.name))
    return model.SerializeToString()


def conv_bn_model(channels: int = 16, size: int = 32) -> bytes:
    """Conv -> BatchNormalization -> Relu over x[N, 3, size, size], its weights in Constant nodes as
    paddle2onnx exports them (PP-OCR): the BatchNormalization folds into the Conv's weights."""
    rng = np.random.default_rng(11)
    arrays = {
        "w": rng.standard_normal((channels, 3, 3, 3)).astype(np.float32) * 0.2,
        "scale": (1.0 + rng.standard_normal(channels) * 0.1).astype(np.float32),
        "bias": rng.standard_normal(channels).astype(np.float32) * 0.1,
        "mean": rng.standard_normal(channels).astype(np.float32) * 0.1,
        "var": (1.0 + rng.random(channels)).astype(np.float32),
    }
    constants = [
        helper.make_node("Constant", [], [name], value=numpy_helper.from_array(array, name))
        for name, array in arrays.items()
    ]
    nodes = [
        *constants,
        helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "scale", "bias", "mean", "var"], ["b"]),
        helper.make_node("Relu", ["b"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "conv_bn",
        [value("x", "float32", ["N", 3, size, size])],
        [value("y", "float32", ["N", channels, size, size])],
    )
    return make_model(graph).SerializeToString()


def heavy_model(weight_bytes: int) -> bytes:
    """``x: [batch, n] @ W: [n, n]`` with ``W`` about ``weight_bytes`` of float32: a model that weighs."""
    n = int((weight_bytes / 4) ** 0.5)
    weight = np.random.default_rng(5).random((n, n), dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "heavy",
        [value("x", "float32", ["batch", n])],
        [value("y", "float32", ["batch", n])],
        initializer=[numpy_helper.from_array(weight, "W")],
    )
    return make_model(graph, check=False).SerializeToString()


def fpn_model(seed: int = 5) -> bytes:
    """A detector's neck in miniature, ``x[1, 4, h, w]``: two stride-2 convs, the deeper map upsampled 2x
    (Resize, nearest) and added to the shallower one, then a pointwise conv. Its shapes agree only when
    h and w are multiples of 4 (ONNX Runtime refuses other sizes, as it does a DBNet's non-multiples of 32)."""
    rng = np.random.default_rng(seed)

    def weight(name: str, shape: tuple[int, ...]) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)

    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("Resize", ["c2", "", "scales"], ["up"], mode="nearest"),
        helper.make_node("Add", ["up", "r1"], ["sum"]),
        helper.make_node("Conv", ["sum", "w3"], ["y"], kernel_shape=[1, 1]),
    ]
    initializer = [
        weight("w1", (8, 4, 3, 3)),
        weight("w2", (8, 8, 3, 3)),
        weight("w3", (4, 8, 1, 1)),
        numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"),
    ]
    inputs, outputs = [value("x", "float32", [1, 4, "h", "w"])], [value("y", "float32", [1, 4, "h2", "w2"])]
    graph = helper.make_graph(nodes, "fpn", inputs, outputs, initializer)
    return make_model(graph).SerializeToString()


def fixed_size_model(size: int = 32) -> bytes:
    """A classifier on x[batch, 3, H, W] that runs at H = W = ``size`` only, though both are symbolic in
    its graph (an exported detector's grid baked in): x + a [1, 3, size, size] constant, averaged to y[batch, 3]."""
    grid = np.random.default_rng(9).standard_normal((1, 3, size, size)).astype(np.float32)
    nodes = [
        helper.make_node("Add", ["x", "grid"], ["shifted"], name="fixed_grid_add"),
        helper.make_node("GlobalAveragePool", ["shifted"], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "fixed_size",
        [value("x", "float32", ["batch", 3, "H", "W"])],
        [value("y", "float32", ["batch", 3])],
        initializer=[numpy_helper.from_array(grid, "grid")],
    )
    return make_model(graph).SerializeToString()


def long_axis_mix_model(threshold: int = 150) -> bytes:
    """``y = x + mean(x over W)`` on x[batch, 8, W] where W > ``threshold``, else ``y = x``: padding W looks
    harmless at every size the probe tries below the threshold, and changes the outputs of a request of
    W <= threshold padded past it (a model made to pass a small probe and fail at real sizes)."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "w_index"], ["width"], axis=0),
        helper.make_node("Greater", ["width", "threshold"], ["long"]),
        helper.make_node("Cast", ["long"], ["gate"], to=TensorProto.FLOAT),
        helper.make_node("ReduceMean", ["x"], ["mean"], axes=[2], keepdims=1),
        helper.make_node("Mul", ["mean", "gate"], ["gated"]),
        helper.make_node("Add", ["x", "gated"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "long_axis_mix",
        [value("x", "float32", ["batch", 8, "W"])],
        [value("y", "float32", ["batch", 8, "W"])],
        initializer=[
            numpy_helper.from_array(np.array(2, dtype=np.int64), "w_index"),
            numpy_helper.from_array(np.array(threshold, dtype=np.int64), "threshold"),
        ],
    )
    return make_model(graph).SerializeToString()


def conv_pool_model(channels: int = 8) -> bytes:
    """A strided 3x3 conv, Relu and global average pooling on x[N, 3, H, W] -> y[N, channels]: a
    classifier's shape, whose pooling averages any padding of H or W into every output."""
    weight = np.random.default_rng(6).standard_normal((channels, 3, 3, 3)).astype(np.float32) * 0.2
    bias = np.linspace(-0.5, 0.5, channels).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("GlobalAveragePool", ["r"], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "conv_pool",
        [value("x", "float32", ["N", 3, "H", "W"])],
        [value("y", "float32", ["N", channels])],
        initializer=[numpy_helper.from_array(weight, "w"), numpy_helper.from_array(bias, "b")],
    )
    return make_model(graph).SerializeToString()


def saturation_model(*, wrong: bool = False) -> bytes:
    """``y = 0.5 x`` on x[batch, 16]; ``wrong`` adds Relu(x - 200): the same answers on every input
    verification draws, different ones on saturated pixels (255), as a miscompiled kernel would give."""
    nodes = [helper.make_node("Mul", ["x", "half"], ["y" if not wrong else "scaled"])]
    if wrong:
        nodes += [
            helper.make_node("Sub", ["x", "knee"], ["over"]),
            helper.make_node("Relu", ["over"], ["excess"]),
            helper.make_node("Add", ["scaled", "excess"], ["y"]),
        ]
    graph = helper.make_graph(
        nodes,
        "saturation",
        [value("x", "float32", ["batch", 16])],
        [value("y", "float32", ["batch", 16])],
        initializer=[numpy_helper.from_array(np.array(0.5, dtype=np.float32), "half")]
        + ([numpy_helper.from_array(np.array(200.0, dtype=np.float32), "knee")] if wrong else []),
    )
    return make_model(graph).SerializeToString()
