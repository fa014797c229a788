"""ONNX -> Relax: TVM's importer, with the fixes jitserve's buckets need."""

from __future__ import annotations

import math
import re

import numpy as np
import onnx
import tvm
from tvm import relax
from tvm.relax.frontend.onnx.onnx_frontend import ONNXGraphImporter

from ..shapes.buckets import dim_range, dim_step

# Binary ops whose operands' shapes must agree (or broadcast).
ELEMENTWISE = ("Add", "Sub", "Mul", "Div")


class Importer(ONNXGraphImporter):
    """TVM's ONNX importer, where a symbolic dim must stay exact through every op, and which records
    the ONNX node each Relax binding came from (TVM's importer keeps no spans and drops node names).

    Each node's tensor result is bound to a var named after the node (``conv12``: op type and position)
    and every binding its converter emitted before that one belongs to the same node; the passes keep
    binding names, so a fused kernel's bindings name the nodes it computes (:mod:`.explain`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.converted: list[tuple[str, str, list[str], list[str]]] = []
        """(op type, node name, input names, output names) of every node converted, in graph order; an
        unnamed node is named by its first output."""
        self._node_io: tuple[list[str], list[str]] = ([], [])
        self.bound: dict[str, int] = {}
        """A Relax var's name -> the index in ``converted`` of the node whose result it is."""
        self._subgraphs = 0

    def _convert_operator(self, op_name: str, inputs: list, attrs: dict, opset: int):
        if op_name == "Resize":
            inputs = _integral_scales(inputs)
        elif op_name in ("Concat", *ELEMENTWISE):
            inputs = self._agreeing_shapes(inputs, attrs.get("axis", 0) if op_name == "Concat" else None)
        result = self._constant_clip(inputs, attrs, opset) if op_name == "Clip" else None
        if op_name == "Range" and (counted := _counting_range(inputs)) is not None:
            result = self.bb.normalize(counted)
        elif op_name == "Reshape":
            result = _scalar_as_shape(inputs)
        elif op_name in ("MaxPool", "AveragePool"):
            result = self._pool_past_a_short_map(op_name, inputs, attrs, opset)
        if result is None:
            result = super()._convert_operator(op_name, inputs, attrs, opset)
        index = len(self.converted)
        self.converted.append((op_name, str(attrs.get("tvm_custom", {}).get("name", "")), *self._node_io))
        name = f"{_identifier(op_name)}{index}"
        if self._subgraphs == 0 and isinstance(result, relax.Tuple):  # several outputs (LayerNormalization)
            result = relax.Tuple([self._bind(field, f"{name}_{k}", index) for k, field in enumerate(result.fields)])
        elif self._subgraphs == 0:
            result = self._bind(result, name, index)
        return result

    def _constant_clip(self, inputs: list, attrs: dict, opset: int) -> relax.Expr | None:
        """A float Clip with constant bounds (ReLU6, hardswish) as Relax's ``maximum`` / ``minimum``: the
        frontend's TE kernels hide it from ConvertLayout, which then puts transforms around every one
        in a channel-blocked model. ``None`` for any other Clip (the frontend's form)."""
        x = inputs[0]
        dtype = getattr(x.ty, "dtype", "")
        if not str(dtype).startswith("float"):
            return None
        if opset < 11:
            bounds = [attrs.get("min"), attrs.get("max")]
        else:
            given = list(inputs[1:3]) + [None] * (3 - len(inputs))
            if any(b is not None and not isinstance(b, tvm.ir.GenericConst) for b in given[:2]):
                return None
            bounds = [None if b is None else b.value.numpy() for b in given[:2]]
            if any(b is not None and b.size != 1 for b in bounds):
                return None
            bounds = [None if b is None else float(b.reshape(())) for b in bounds]
        result = x
        for bound, op in zip(bounds, (relax.op.maximum, relax.op.minimum), strict=True):
            if bound is not None and math.isfinite(bound):  # NaN leaves that side unbounded (ONNX)
                operand = self.bb.emit(result) if isinstance(result, relax.Call) else result
                result = op(operand, relax.const(bound, dtype))
        return result  # the last op unbound: _bind names it after the node

    def _agreeing_shapes(self, inputs: list, axis: int | None) -> list:
        """The inputs of a Concat (but on ``axis``) or of an elementwise op, each dim TVM cannot prove
        equal to the first input's cast to it. Over a plain symbolic height a detector's 2x upsample of one
        level, ``(H - 1) // 32 * 2 + 2``, meets the level above, ``(H - 1) // 16 + 1``: they agree at some
        heights only (ONNX Runtime refuses the others), and its box count, a product divided back, meets
        its anchors' count. The frontend gave such a result no shape and the next op failed (``object of
        type 'NoneType' has no len()``). The cast is checked when the kernel runs: it refuses the sizes
        ONNX Runtime refuses. Dims of 1 (a broadcast) and constant ones are left as they are."""
        shapes = [getattr(getattr(x, "ty", None), "shape", None) for x in inputs]
        if len(inputs) < 2 or not all(isinstance(shape, relax.ShapeExpr) for shape in shapes):
            return inputs
        rank = max(len(shape.values) for shape in shapes)
        # Right-aligned, as broadcasting aligns them; the first dim other than 1 at each position.
        aligned = [[None] * (rank - len(shape.values)) + list(shape.values) for shape in shapes]
        columns = zip(*aligned, strict=True)
        first = [next((d for d in dims if d is not None and not _is_one(d)), None) for dims in columns]
        along = None if axis is None else axis % rank
        analyzer = tvm.sym.Analyzer()
        agreed = []
        for x, dims in zip(inputs, aligned, strict=True):
            cast = [
                f if i != along and _symbolic(d, f) and not analyzer.can_prove_equal(d, f) else d
                for i, (d, f) in enumerate(zip(dims, first, strict=True))
            ]
            if all(c is d for c, d in zip(cast, dims, strict=True)):
                agreed.append(x)
                continue
            agreed.append(self.bb.match_cast(x, relax.TensorType([c for c in cast if c is not None], x.ty.dtype)))
        return agreed

    def _pool_past_a_short_map(self, op_name: str, inputs: list, attrs: dict, opset: int) -> relax.Expr | None:
        """A pool whose map may be shorter than its window (PP-OCR cls's last 2x2 MaxPool over a map one
        row high, at input heights 17..32), as ONNX Runtime computes it: one output there, over the part of
        the window on the map. TVM, as the ONNX spec, counts ``floor((size + pads - window) / stride) + 1``
        outputs, none for that map, and the GlobalAveragePool after it averaged nothing: NaN. ONNX Runtime
        divides in C++ (toward zero) and clips the window. Here the map is padded at its end up to the
        window (pads count for nothing in a max, nor in an average without ``count_include_pad``), and a
        symbolic map's extra outputs at larger sizes are cut off. ``None`` for any other pool."""
        auto_pad = attrs.get("auto_pad", b"NOTSET")
        if attrs.get("ceil_mode", 0) or (auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad) != "NOTSET":
            return None
        if op_name == "AveragePool" and attrs.get("count_include_pad", 0):
            return None
        shape = getattr(inputs[0].ty, "shape", None)
        if shape is None or not isinstance(shape, relax.ShapeExpr) or "kernel_shape" not in attrs:
            return None
        kernel = list(attrs["kernel_shape"])
        rank = len(kernel)
        strides = list(attrs.get("strides", [1] * rank))
        dilations = list(attrs.get("dilations", [1] * rank))
        pads = list(attrs.get("pads", [0] * 2 * rank))
        spatial = list(shape.values)[2:]
        # How far the last window may start past the map's first: negative where the map is shorter.
        reach = [size + pads[i] + pads[rank + i] - dilations[i] * (kernel[i] - 1) - 1 for i, size in enumerate(spatial)]
        short = [max(0, -_smallest(r)) for r in reach]
        if not any(short):
            return None
        widened = dict(attrs, pads=[*pads[:rank], *(p + s for p, s in zip(pads[rank:], short, strict=True))])
        pooled = self.bb.emit(super()._convert_operator(op_name, inputs[:1], widened, opset))
        wanted = [tvm.tirx.Max(r, tvm.tirx.IntImm("int64", 0)) // s + 1 for r, s in zip(reach, strides, strict=True)]
        analyzer = tvm.sym.Analyzer()
        cut = [i for i, (have, want) in enumerate(zip(pooled.ty.shape.values[2:], wanted, strict=True))
               if short[i] and not analyzer.can_prove_equal(have, want)]  # fmt: skip
        if not cut:
            return pooled
        ends = [wanted[i] for i in cut]
        return self.bb.normalize(
            relax.op.strided_slice(pooled, [2 + i for i in cut], [0] * len(cut), ends, assume_inbound=True)
        )

    def _parse_value_proto(self, value_proto):
        # An unnamed node is known by its first output, as :func:`compiler.measuring.profile.named_nodes` names it for
        # ONNX Runtime's profile: the two sides join on these names.
        name = super()._parse_value_proto(value_proto)
        if not isinstance(value_proto, onnx.NodeProto):
            return name
        self._node_io = (list(value_proto.input), list(value_proto.output))  # for _convert_operator, next
        return name or (value_proto.output[0] if value_proto.output else "")

    def _bind(self, value, name: str, index: int):
        if isinstance(value, relax.Call) and isinstance(value.ty, relax.TensorType | relax.TupleType):
            value = self.bb.emit(value, name_hint=name)
        if isinstance(value, relax.Var):
            self.bound.setdefault(value.name, index)
        return value

    def _convert_subgraph(self, bb, graph):
        # A branch's bindings are its own block's: named as TVM names them.
        self._subgraphs += 1
        try:
            return super()._convert_subgraph(bb, graph)
        finally:
            self._subgraphs -= 1


def _is_one(dim) -> bool:
    return isinstance(dim, tvm.tirx.IntImm) and dim.value == 1


def _symbolic(dim, other) -> bool:
    """Both dims given, neither 1, one of them symbolic: a pair only a check at run time can match."""
    if dim is None or other is None or _is_one(dim) or _is_one(other):
        return False
    return not (isinstance(dim, tvm.tirx.IntImm) and isinstance(other, tvm.tirx.IntImm))


def _smallest(size) -> int:
    """A shape expression's smallest value over its dims' ranges: a bucket's symbolic dim is named with
    its range (``x:2@17..64``, a stepped one's var counts steps); a dim named without one is at least 1."""
    size = tvm.tirx.IntImm("int64", size) if isinstance(size, int) else size
    analyzer = tvm.sym.Analyzer()
    for var in tvm.tirx.analysis.undefined_vars(size):
        step = dim_step(var.name)
        low, high = dim_range(var.name) or (1, 1 << 40)
        low, high = max(-(-low // step), 1), max(high // step, 1)
        analyzer.bind(var, tvm.ir.Range.from_min_extent(low, high - low + 1))
    return int(analyzer.const_int_bound(size).min_value)


def _identifier(op_type: str) -> str:
    return re.sub(r"[^0-9a-zA-Z]+", "_", op_type).strip("_").lower() or "node"


def _constant_int(value) -> int | None:
    """A one-element integer constant's value; a float one's too where it is a whole number (a grid's
    ``Range(0.0, w, 1.0)``)."""
    if isinstance(value, tvm.ir.GenericConst) and value.value.numpy().size == 1:
        number = value.value.numpy().reshape(())
        if np.issubdtype(number.dtype, np.floating) and np.isfinite(number) and number == np.round(number):
            return int(number)
        return int(number) if np.issubdtype(number.dtype, np.integer) else None
    return None


def _counting_range(inputs: list) -> relax.Expr | None:
    """``Range(start, n, step)`` over a sequence's symbolic length ``n`` (a decoder's positions), constant
    start and step, as ``arange``, whose shape TVM knows: the frontend computes its length as a tensor, and
    every shape after it (the position embeddings, the attention heads' Reshape) is unknown. A float
    Range over a map's symbolic width cast to float (a detector's anchor grid) counts the same whole
    numbers, in float. ``None`` for any other Range (the frontend's form)."""
    if len(inputs) != 3 or not tvm.ir.is_prim_expr(inputs[1]):
        return None
    limit, dtype = inputs[1], str(getattr(inputs[1], "dtype", None) or inputs[1].ty)
    if dtype.startswith("float") and isinstance(limit, tvm.tirx.Cast) and str(limit.value.ty) == "int64":
        limit = limit.value  # exact: a float32 counts whole numbers exactly up to 2**24
    elif dtype != "int64":
        return None
    start, step = _constant_int(inputs[0]), _constant_int(inputs[2])
    if start is None or step is None or step <= 0:
        return None
    return relax.op.arange(start, limit, step, dtype)


def _scalar_as_shape(inputs: list) -> relax.Expr | None:
    """A Reshape of a symbolic scalar (GPT-2's ``seq + 1``) to one element, as a one-element shape: what
    the frontend makes of an Unsqueeze of one (it refuses the Reshape). ``None`` for any other Reshape."""
    if len(inputs) < 2 or not tvm.ir.is_prim_expr(inputs[0]) or not isinstance(inputs[1], tvm.ir.GenericConst):
        return None
    target = inputs[1].value.numpy().tolist()
    if target in ([1], [-1]):
        return relax.ShapeExpr([inputs[0]])
    return inputs[0] if target == [] else None


def _integral_scales(inputs: list) -> list:
    """TVM computes a Resize's output size as ``int64(float(dim) * scale)``: exact for a static dim, but
    a symbolic one gives an expression no other shape can be proved equal to, so the FPN of a detector
    (a 2x upsample added to the map one level up) loses its shape. Whole-number scales, handed over as
    a shape, make it ``dim * scale``."""
    if len(inputs) < 3 or not isinstance(inputs[2], tvm.ir.GenericConst):
        return inputs
    scales = inputs[2].value.numpy()
    if scales.size == 0 or not np.all(scales == np.round(scales)) or np.any(scales < 1):
        return inputs
    return [*inputs[:2], relax.ShapeExpr([int(s) for s in scales]), *inputs[3:]]


def import_onnx(
    model: onnx.ModelProto, shape_dict: dict[str, list], dtype_dict: dict[str, str]
) -> tuple[tvm.IRModule, Importer]:
    """What ``tvm.relax.frontend.onnx.from_onnx`` does with its defaults, through :class:`Importer`
    (returned too: what it recorded of each node)."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    importer = Importer(shape_dict, dtype_dict)
    return importer.from_onnx(model.graph, opset), importer


def read_steps(mod: tvm.IRModule, steps: list[tuple[tvm.tirx.Var, int]]) -> tvm.IRModule:
    """Let ``main`` take inputs whose dims were imported as ``step * var``.

    A detector's layers halve its input k times, and only an input that is a multiple of 2^k keeps
    every level's shape provable (the 2x upsample of one level added to the level above), so such a
    dim is imported as ``step * var``. The VM cannot solve ``step * var`` from an input's shape: the
    inputs take plain sizes, and the function's first bindings read each ``var = size // step`` and
    check the input is ``step * var``, binding the very variable the imported body uses."""
    if not steps:
        return mod
    main = mod["main"]
    num_inputs = int(main.attrs["num_input"]) if main.attrs and "num_input" in main.attrs else len(main.params)
    by_name = {var.name: (var, step) for var, step in steps}  # a PrimExpr's == builds an expression
    sizes = {name: tvm.tirx.Var(f"{name}*{step}", "int64") for name, (_, step) in by_name.items()}
    params, casts = [], []
    for index, param in enumerate(main.params):
        shape = param.ty.shape.values if index < num_inputs and param.ty.shape is not None else None
        stepped = [_stepped_name(dim, by_name) for dim in shape] if shape is not None else []
        if not any(stepped):
            params.append(param)
            continue
        dims = [sizes[name] if name else dim for name, dim in zip(stepped, shape, strict=True)]
        plain = relax.Var(param.name, relax.TensorType(dims, param.ty.dtype))
        params.append(plain)
        casts.append(relax.MatchCast(param, plain, param.ty))
    # Through a tensor and back: bound straight to ``size // step``, each var would be replaced by that
    # expression wherever it is used (CanonicalizeBindings), and FuseTIR takes only plain vars.
    counts = relax.ShapeExpr([sizes[name] // step for name, (_, step) in by_name.items()])
    as_tensor = relax.Var("step_counts", relax.TensorType([len(by_name)], "int64"))
    opaque = relax.Var("step_shape", relax.ShapeType(ndim=len(by_name)))
    variables = relax.ShapeType([var for var, _ in by_name.values()])
    read = [
        relax.VarBinding(as_tensor, relax.op.shape_to_tensor(counts)),
        relax.VarBinding(opaque, relax.op.tensor_to_shape(as_tensor)),
        relax.MatchCast(relax.Var("steps", variables), opaque, variables),
    ]
    body = relax.SeqExpr([relax.BindingBlock([*read, *casts]), *main.body.blocks], main.body.body)
    mod["main"] = relax.Function(params, body, main.ret_ty, main.is_pure, main.attrs)
    return relax.transform.Normalize()(mod)


def _stepped_name(dim, by_name: dict[str, tuple]) -> str | None:
    """The name of the var of a ``step * var`` (or ``var * step``) dim."""
    if isinstance(dim, tvm.tirx.Mul):
        for var, factor in ((dim.a, dim.b), (dim.b, dim.a)):
            known = by_name.get(getattr(var, "name", None))
            if known and known[0].same_as(var) and isinstance(factor, tvm.tirx.IntImm) and factor.value == known[1]:
                return var.name
    return None
