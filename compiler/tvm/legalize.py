"""jitserve's own lowerings of Relax ops whose default TE form wastes work on the CPU.

``conv2d_transpose`` with kernel == stride (the 2x upsampling of U-Nets, FPNs and
DBNet's head) has each output pixel fed by exactly one input pixel per input
channel. TOPI's form dilates the input with zeros and runs a full convolution
over them: s*s times the MACs, and a dilated copy of the input (PP-OCRv4 det:
8.6 ms of a 35 ms run on AMD EPYC Zen 5 against 1.25 ms in ONNX Runtime). Here
it is a GEMM per output phase, which the contraction rule tiles like a
pointwise conv, followed by an interleave of the phases into the output.

A pointwise ``conv2d`` (1x1, stride 1, no padding) on a feature map whose
width fills no whole vector tile (a detector's 20x20 and 40x40 stages)
vectorizes that width: 4 of 16 lanes at width 20, or a computation padded to
32. As a matmul over the flattened map (H*W columns, contiguous in NCHW) it
gets whole vector tiles: 384 -> 384 channels at 20x20 ran 2.04 -> 0.51 ms
with AVX-512 and 3.34 -> 0.92 ms with AVX2 kernels (AMD EPYC Zen 5).

A ``conv2d`` whose output width is symbolic (the dynamic tier), or static
but divisible by no tile that uses most of a vector's lanes (rec's 25 and 50
at width 100), is computed on that width rounded up to the vector tile, from
an input zero-padded to match, and cut back in the epilogue. The contraction then runs whole vector
tiles only; the last tile's guard stays on its stores. Guarded inside the
accumulation, the last tile ran scalar with its accumulators in memory: 6.2
against 0.36 ms for a whole 240 -> 240 1x1 conv at width 65 against 64.

Runs in the compile child only (imports TVM).
"""

from __future__ import annotations

import tvm
from tvm import relax, te, topi

from .resize import two_pass_resize
from .schedules.base import (
    SymbolicBounds,
    extent_bound,
    pick_factor,
    planning_bounds,
    symbolic_tile,
    vector_lanes,
    whole_vector_tile,
)
from .shapes import static_shape
from .shared_kernels import SHARED_ELEMENTWISE, BuiltOnce


def _channels_static(expr: relax.Expr) -> bool:
    """An NCHW tensor whose batch and channels are constants (its height and width may be symbolic)."""
    shape = getattr(expr.ty, "shape", None)
    dims = list(shape.values) if shape is not None and hasattr(shape, "values") else None
    return dims is not None and len(dims) == 4 and all(isinstance(d, tvm.tirx.IntImm) for d in dims[:2])


def _on_cpu() -> bool:
    # CUDA keeps TVM's lowerings: these were measured, and are tested, on the CPU only.
    target = tvm.target.Target.current(allow_none=True)
    return target is not None and target.kind.name == "llvm"


def _is_upsampling_transpose(call: relax.Call) -> bool:
    attrs = call.attrs
    weight_shape = static_shape(call.args[1])
    if not _on_cpu() or weight_shape is None or len(weight_shape) != 4 or not _channels_static(call.args[0]):
        return False
    strides = [int(s) for s in attrs.strides]
    kernel = weight_shape[2:]
    return (
        attrs.data_layout == "NCHW"
        and attrs.kernel_layout == "IOHW"
        and attrs.out_layout == "NCHW"
        and int(attrs.groups) == 1
        and kernel == strides
        and all(int(p) == 0 for p in attrs.padding)
        and all(int(p) == 0 for p in attrs.output_padding)
        and all(int(d) == 1 for d in attrs.dilation)
    )


def _conv2d_transpose(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    if not _is_upsampling_transpose(call):
        return _DEFAULT_CONV2D_TRANSPOSE(bb, call)
    out_dtype = call.ty.dtype
    _, out_channels, sy, sx = static_shape(call.args[1])

    def phases(data: te.Tensor, weight: te.Tensor) -> te.Tensor:
        # phase[n, a, b, o, i, j] feeds output pixel (i*sy + a, j*sx + b): rows o, columns j (contiguous in data).
        batch, in_channels, height, width = (_dim(d) for d in data.shape)  # the kernel's own vars (see conv)
        rc = te.reduce_axis((0, in_channels), name="rc")
        return te.compute(
            (batch, sy, sx, out_channels, height, width),
            lambda n, a, b, o, i, j: te.sum(
                data[n, rc, i, j].astype(out_dtype) * weight[rc, o, a, b].astype(out_dtype), axis=rc
            ),
            name="conv2d_transpose_phases",
        )

    def interleave(phase: te.Tensor) -> te.Tensor:
        batch, _, _, _, height, width = (_dim(d) for d in phase.shape)
        return te.compute(
            (batch, out_channels, height * sy, width * sx),
            lambda n, o, y, x: phase[n, y % sy, x % sx, o, y // sy, x // sx],
            name="conv2d_transpose_interleave",
        )

    phase = bb.emit_te(phases, call.args[0], call.args[1], primfunc_name_hint="conv2d_transpose_phases")
    return bb.call_te(interleave, phase, primfunc_name_hint="conv2d_transpose_interleave")


def _flattened_pointwise(call: relax.Call) -> bool:
    """A 1x1 conv whose map, flattened, fills vectors that its width alone does not."""
    attrs = call.attrs
    weight_shape = static_shape(call.args[1])
    if not _on_cpu() or weight_shape is None or not _channels_static(call.args[0]):
        return False
    if call.ty.dtype != "float32":
        return False
    pointwise = (
        attrs.data_layout == "NCHW"
        and attrs.kernel_layout == "OIHW"
        and attrs.out_layout == "NCHW"
        and int(attrs.groups) == 1
        and weight_shape[2:] == [1, 1]
        and all(int(s) == 1 for s in attrs.strides)
        and all(int(p) == 0 for p in attrs.padding)
    )
    lanes = vector_lanes(tvm.target.Target.current(), "float32")
    height, width = (_dim(d) for d in call.args[0].ty.shape.values[2:])
    if not isinstance(height, int) or not isinstance(width, int):
        # Symbolic (the dynamic tier): one matmul over the flattened map leaves a tail once, not per row.
        return pointwise and extent_bound(height * width) is not None
    return pointwise and (whole_vector_tile(width, lanes) or 0) < (whole_vector_tile(height * width, lanes) or 0)


def _pads_width(call: relax.Call) -> bool:
    """An NCHW conv computed better on a width rounded up to whole vectors: a symbolic width (the
    dynamic tier), or a static one whose whole-vector tiles would use fewer of the lanes (rec's width
    25 or 50: no tile of 16 lanes divides them)."""
    attrs = call.attrs
    weight_shape = static_shape(call.args[1])
    data_shape = getattr(call.args[0].ty, "shape", None)
    out_shape = getattr(call.ty, "shape", None)
    if not _on_cpu() or weight_shape is None or data_shape is None or out_shape is None or call.ty.dtype != "float32":
        return False
    if not (attrs.data_layout == "NCHW" and attrs.kernel_layout == "OIHW" and attrs.out_layout == "NCHW"):
        return False
    if not isinstance(data_shape.values[1], tvm.tirx.IntImm):
        return False
    width = out_shape.values[3]
    if not isinstance(width, tvm.tirx.IntImm):
        # Not a multiple k * W (a detector's levels): the schedule's region analysis cannot prove the padded
        # result covers the cut (min(2W, (W + 7) // 8 * 16) stays); its last tile keeps its guard (contraction.py).
        multiple = tvm.sym.Analyzer().modular_set(width)
        return int(multiple.coeff) <= 1 and extent_bound(width) is not None
    lanes = vector_lanes(tvm.target.Target.current(), "float32")
    width = int(width)
    if width <= lanes:
        return False
    used = min(pick_factor(width, [lanes * 2, lanes, lanes * 4, lanes // 2, lanes // 4]) or 1, lanes)
    return width / (-(-width // lanes) * lanes) > used / lanes


def _dim(value):
    """A shape value as an int when constant (rules read constant extents as IntImm), else as is."""
    return int(value) if isinstance(value, tvm.tirx.IntImm) else value


def _padded_width_conv(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    attrs = call.attrs
    out_dtype = call.ty.dtype
    out_width = _dim(call.ty.shape.values[3])
    out_channels, group_channels, kernel_h, kernel_w = static_shape(call.args[1])
    stride_h, stride_w = (int(s) for s in attrs.strides)
    dilation_h, dilation_w = (int(d) for d in attrs.dilation)
    top, left, bottom, right = (int(p) for p in attrs.padding)
    per_group = out_channels // int(attrs.groups)
    lanes = vector_lanes(tvm.target.Target.current(), "float32")
    tile = symbolic_tile(out_width if isinstance(out_width, int) else extent_bound(out_width), lanes)

    def channel(f, rc):
        # The input channel read by output channel f: f's own (depthwise), or its group's rc-th. A plain conv
        # reads rc alone, so that f indexes only the weights (the rule then blocks f into registers).
        if int(attrs.groups) == 1:
            return rc
        return f // per_group if group_channels == 1 else f // per_group * group_channels + rc

    def conv(data: te.Tensor, weight: te.Tensor) -> te.Tensor:
        # Every dim from ``data``'s own shape: call_te gives the kernel fresh copies of the caller's symbolic
        # vars, and a dim taken from the call's shape would bring the caller's in as a second, unrelated var.
        batch, in_channels, height, width = (_dim(d) for d in data.shape)
        simplify = tvm.sym.Analyzer().simplify  # the form the caller's shapes have: 8H, not (16H - 1) // 2 + 1
        out_height = _dim(simplify((height + top + bottom - (kernel_h - 1) * dilation_h - 1) // stride_h + 1))
        out_width = _dim(simplify((width + left + right - (kernel_w - 1) * dilation_w - 1) // stride_w + 1))
        padded_width = (out_width + tile - 1) // tile * tile
        in_rows = (out_height - 1) * stride_h + (kernel_h - 1) * dilation_h + 1
        in_columns = (padded_width - 1) * stride_w + (kernel_w - 1) * dilation_w + 1
        pad = te.compute(
            (batch, in_channels, in_rows, in_columns),
            lambda n, c, y, x: tvm.tirx.if_then_else(
                tvm.tirx.all(y >= top, y < height + top, x >= left, x < width + left),
                data[n, c, y - top, x - left],
                tvm.tirx.const(0.0, data.dtype),
            ),
            name="pad_temp",
        )
        rc = te.reduce_axis((0, group_channels), name="rc")
        ry = te.reduce_axis((0, kernel_h), name="ry")
        rx = te.reduce_axis((0, kernel_w), name="rx")
        padded = te.compute(
            (batch, out_channels, out_height, padded_width),
            lambda n, f, y, x: te.sum(
                pad[n, channel(f, rc), y * stride_h + ry * dilation_h, x * stride_w + rx * dilation_w].astype(out_dtype)
                * weight[f, rc, ry, rx].astype(out_dtype),
                axis=[rc, ry, rx],
            ),
            name="conv2d_nchw",
        )
        return te.compute(
            (batch, out_channels, out_height, out_width), lambda n, f, y, x: padded[n, f, y, x], name="conv2d_cut"
        )

    return bb.call_te(conv, call.args[0], call.args[1], primfunc_name_hint="conv2d")


def _blocked_conv(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """A conv with its output channel-blocked (layout.py): out[n, o, y, x, oi] is output channel o*b + oi.
    The kernel is [o, ic/b, kh, kw, b(ic), b(oc)] where the input is blocked too, else [o, ic, kh, kw, b(oc)]
    (the first layer's few input channels, read in NCHW; a depthwise conv's one). The input-channel block loop sits
    outside the window, its lanes inside: each window step reads b contiguous weight vectors."""
    attrs = call.attrs
    out_dtype = call.ty.dtype
    stride_h, stride_w = (int(s) for s in attrs.strides)
    dilation_h, dilation_w = (int(d) for d in attrs.dilation)
    top, left, bottom, right = (int(p) for p in attrs.padding)
    groups = int(attrs.groups)
    blocked_input = len(call.args[0].ty.shape.values) == 5
    depthwise = groups > 1 and len(call.args[1].ty.shape.values) != 6
    data = call.args[0]
    if _subsamples(call, blocked_input):
        data = bb.emit_te(_subsample, data, stride_h, stride_w, primfunc_name_hint="subsample")
        stride_h = stride_w = 1

    def conv(data: te.Tensor, weight: te.Tensor) -> te.Tensor:
        batch, in_blocks, height, width = (_dim(d) for d in data.shape[:4])
        out_blocks, group_blocks, kernel_h, kernel_w = (int(d) for d in weight.shape[:4])
        block = int(weight.shape[-1])
        out_height = (height + top + bottom - (kernel_h - 1) * dilation_h - 1) // stride_h + 1
        out_width = (width + left + right - (kernel_w - 1) * dilation_w - 1) // stride_w + 1
        in_columns = width + left + right
        padded = data
        if top or left or bottom or right:
            padded = te.compute(
                (batch, in_blocks, height + top + bottom, in_columns, *data.shape[4:]),
                lambda n, c, y, x, *lane: tvm.tirx.if_then_else(
                    tvm.tirx.all(y >= top, y < height + top, x >= left, x < width + left),
                    data[(n, c, y - top, x - left, *lane)],
                    tvm.tirx.const(0.0, data.dtype),
                ),
                name="pad_temp",
            )
        ry = te.reduce_axis((0, kernel_h), name="ry")
        rx = te.reduce_axis((0, kernel_w), name="rx")

        def window(y, x):
            return y * stride_h + ry * dilation_h, x * stride_w + rx * dilation_w

        if depthwise:  # channel block o reads input block o, lane for lane

            def body(n, o, y, x, oi):
                row, column = window(y, x)
                return te.sum(
                    padded[n, o, row, column, oi].astype(out_dtype) * weight[o, 0, ry, rx, oi].astype(out_dtype),
                    axis=[ry, rx],
                )

        elif blocked_input:
            rco = te.reduce_axis((0, group_blocks), name="rco")
            rci = te.reduce_axis((0, int(weight.shape[4])), name="rci")
            per_group = out_blocks // groups

            def body(n, o, y, x, oi):
                row, column = window(y, x)
                first = o // per_group * group_blocks if groups > 1 else 0  # the group's first input block
                return te.sum(
                    padded[n, first + rco, row, column, rci].astype(out_dtype)
                    * weight[o, rco, ry, rx, rci, oi].astype(out_dtype),
                    axis=[rco, ry, rx, rci],
                )

        else:
            rc = te.reduce_axis((0, group_blocks), name="rc")

            def body(n, o, y, x, oi):
                row, column = window(y, x)
                return te.sum(
                    padded[n, rc, row, column].astype(out_dtype) * weight[o, rc, ry, rx, oi].astype(out_dtype),
                    axis=[rc, ry, rx],
                )

        return te.compute((batch, out_blocks, out_height, out_width, block), body, name="conv2d_nchwc")

    return bb.call_te(conv, data, call.args[1], primfunc_name_hint="conv2d_nchwc")


def _subsamples(call: relax.Call, blocked_input: bool) -> bool:
    """A strided 1x1 conv over a blocked map (ResNet's downsample shortcut) reads every s-th pixel: its
    weights met half-used cache lines of an input twice the size."""
    kernel = static_shape(call.args[1])
    attrs = call.attrs
    return (
        blocked_input
        and kernel is not None
        and int(attrs.groups) == 1
        and kernel[2:4] == [1, 1]
        and any(int(s) > 1 for s in attrs.strides)
        and not any(int(p) for p in attrs.padding)
        and all(int(d) == 1 for d in attrs.dilation)
        and all(isinstance(d, tvm.tirx.IntImm) for d in call.args[0].ty.shape.values)
    )


def _subsample(data: te.Tensor, stride_h: int, stride_w: int) -> te.Tensor:
    batch, blocks, height, width, lanes = (int(d) for d in data.shape)
    shape = (batch, blocks, (height - 1) // stride_h + 1, (width - 1) // stride_w + 1, lanes)
    return te.compute(shape, lambda n, c, y, x, i: data[n, c, y * stride_h, x * stride_w, i], name="subsample")


def _conv2d(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    if call.attrs.out_layout != "NCHW":
        return _blocked_conv(bb, call)
    if not _flattened_pointwise(call):
        return _padded_width_conv(bb, call) if _pads_width(call) else _DEFAULT_CONV2D(bb, call)
    batch, in_channels, height, width = (_dim(d) for d in call.args[0].ty.shape.values)
    out_channels = static_shape(call.args[1])[0]
    out_dtype = call.ty.dtype

    def pointwise(rows: te.Tensor, weight: te.Tensor) -> te.Tensor:
        batch, in_channels, columns = (_dim(d) for d in rows.shape)  # the kernel's own vars (see conv)
        rc = te.reduce_axis((0, in_channels), name="rc")
        return te.compute(
            (batch, out_channels, columns),
            lambda n, o, f: te.sum(rows[n, rc, f].astype(out_dtype) * weight[o, rc, 0, 0].astype(out_dtype), axis=rc),
            name="conv2d_pointwise",
        )

    rows = bb.emit_te(topi.reshape, call.args[0], (batch, in_channels, height * width), primfunc_name_hint="reshape")
    flat = bb.emit_te(pointwise, rows, call.args[1], primfunc_name_hint="conv2d_pointwise")
    return bb.call_te(topi.reshape, flat, (batch, out_channels, height, width), primfunc_name_hint="reshape")


def _layout_transform(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """A layout transform without padding as a gather: each output element reads its input element
    through the inverse map, an injective kernel that fuses with its neighbours. TVM's own writes through
    the map, a kernel FuseOps leaves opaque: ConvNeXt's NCHW8c -> NCHW transform and its NCHW -> NHWC
    transpose ran as two passes over each map, YOLOv8's around each split and concat. Fused, ConvNeXt-Tiny
    ran 0.957x and YOLOv8n 0.929x (0.935x at batch 8), the rest of the zoo alike (AMD EPYC Zen 3, AVX2)."""
    shape = call.args[0].ty.shape
    if not all(isinstance(d, tvm.tirx.IntImm) for d in shape.values):
        return _DEFAULT_LAYOUT_TRANSFORM(bb, call)
    index_map = call.attrs.index_map
    inverse, padding = index_map.non_surjective_inverse(shape)
    if not (isinstance(padding, tvm.tirx.IntImm) and int(padding) == 0):
        return _DEFAULT_LAYOUT_TRANSFORM(bb, call)
    out_shape = index_map.map_shape(list(shape))

    def gather(data: te.Tensor) -> te.Tensor:
        return te.compute(out_shape, lambda *out: data[tuple(inverse.map_indices(list(out)))], name="layout_transform")

    return bb.call_te(gather, call.args[0], primfunc_name_hint="layout_transform")


def _resize2d(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    two_passes = two_pass_resize(bb, call) if _on_cpu() else None
    return two_passes if two_passes is not None else _DEFAULT_RESIZE2D(bb, call)


_DEFAULT_CONV2D = tvm.ir.Op.get("relax.nn.conv2d").get_attr("FLegalize")
_DEFAULT_LAYOUT_TRANSFORM = tvm.ir.Op.get("relax.layout_transform").get_attr("FLegalize")
_DEFAULT_CONV2D_TRANSPOSE = tvm.ir.Op.get("relax.nn.conv2d_transpose").get_attr("FLegalize")
_DEFAULT_RESIZE2D = tvm.ir.Op.get("relax.image.resize2d").get_attr("FLegalize")


def custom_legalizations(symbolic_bounds: SymbolicBounds | None = None) -> dict:
    """The ``customize_legalize_map`` of ``relax.transform.LegalizeOps``, for one run of it; ``symbolic_bounds``:
    the symbolic dims' ranges (the dynamic tier's tiles are planned at their largest sizes)."""
    bounds = dict(symbolic_bounds or {})

    def planned(legalize):
        def run(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
            with planning_bounds(bounds):
                return legalize(bb, call)

        return run

    return {
        "relax.nn.conv2d": planned(_conv2d),
        "relax.nn.conv2d_transpose": planned(_conv2d_transpose),
        "relax.layout_transform": _layout_transform,
        "relax.image.resize2d": _resize2d,
        **{name: BuiltOnce(name) for name in SHARED_ELEMENTWISE},
    }
