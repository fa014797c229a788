"""Channel-blocked convs (compiler/tvm/layout.py): which conv gets which layout, the taps a dilated conv
drops, and models built with them verified against ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from compiler.building.build import compile_bucket
from compiler.building.target import resolve_target
from compiler.models.model import load_model
from compiler.storage.store import KernelStore
from tests import convnets
from tests.synthetic import make_model, value

tvm = pytest.importorskip("tvm")

from tvm import relax  # noqa: E402

from compiler.tvm.build import import_relax, specialize  # noqa: E402
from compiler.tvm.layout import blocked_layouts, blocks_pay, live_taps, narrow_rows, tap_bands  # noqa: E402
from compiler.tvm.pipeline import tuned_module_stages  # noqa: E402

TARGET = resolve_target("llvm")
# The layout stage's choices for AVX2's 8-lane blocks, whichever CPU runs the tests (AVX-512 blocks by 16).
AVX2 = {**TARGET, "mcpu": "haswell"}


def _conv(data: tuple, weight: tuple, *, groups: int = 1, padding: int = 1) -> relax.Call:
    x = relax.Var("x", relax.TensorType(data, "float32"))
    w = relax.Var("w", relax.TensorType(weight, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        out = bb.emit(relax.op.nn.conv2d(x, w, padding=padding, groups=groups))
        bb.emit_func_output(out)
    return bb.get()["main"].body.blocks[0].bindings[0].value


@pytest.mark.parametrize(
    "data, weight, groups, expected",
    [
        ((1, 64, 14, 14), (64, 64, 3, 3), 1, ["NCHW8c", "OIHW8i8o", "NCHW8c"]),  # regular, a small map
        ((1, 3, 224, 224), (64, 3, 3, 3), 1, ["NCHW", "OIHW8o", "NCHW8c"]),  # the RGB first layer, read as it comes
        ((1, 64, 14, 14), (64, 1, 3, 3), 64, ["NCHW8c", "OIHW8o", "NCHW8c"]),  # depthwise
        ((1, 64, 14, 14), (64, 16, 3, 3), 4, ["NCHW8c", "OIHW8i8o", "NCHW8c"]),  # grouped, 16-channel groups
        ((1, 64, 14, 14), (64, 4, 3, 3), 16, None),  # groups of 4 channels fill no block
        ((1, 64, 14, 14), (12, 64, 3, 3), 1, None),  # 12 output channels fill no block
    ],
    ids=["regular", "first_layer", "depthwise", "grouped", "narrow_groups", "ragged_channels"],
)
def test_each_conv_kind_gets_its_blocked_layout(data, weight, groups, expected):
    assert blocked_layouts(_conv(data, weight, groups=groups), 8) == expected


def _convs(*maps: tuple[int, int]) -> relax.Function:
    """A chain of 3x3 64-channel convs, one per (height, width) map (each the input's size, padding 1)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 64, *maps[0]), "float32"))
    w = relax.Var("w", relax.TensorType((64, 64, 3, 3), "float32"))
    with bb.function("main", [x, w]):
        y = x
        for height, width in maps:
            if tuple(y.ty.shape.values[2:]) != (height, width):
                y = bb.emit(relax.op.image.resize2d(y, (height, width)))
            y = bb.emit(relax.op.nn.conv2d(y, w, padding=1))
        bb.emit_func_output(y)
    return bb.get()["main"]


def test_the_model_is_blocked_where_narrow_rows_hold_most_of_its_conv_work():
    # NCHW vectorizes a row: 2 whole AVX2 vectors tile 96 or 160, one 56 or 14.
    assert narrow_rows(_conv((1, 64, 14, 14), (64, 64, 3, 3)), 8)
    assert not narrow_rows(_conv((1, 64, 14, 96), (64, 64, 3, 3)), 8)
    assert blocks_pay(_convs((56, 56), (28, 28), (14, 14)), 8)  # a classifier
    assert not blocks_pay(_convs((48, 160), (24, 80)), 8)  # a text recognizer's wide maps
    # A detector's neck: one 160x160 conv outweighs three at 40x40 and 20x20.
    assert not blocks_pay(_convs((160, 160), (40, 40), (40, 40), (20, 20)), 8)


def test_a_conv_with_symbolic_map_stays_nchw():
    h = tvm.tirx.Var("h", "int64")
    assert blocked_layouts(_conv((1, 64, h, 14), (64, 64, 3, 3)), 8) is None


def test_live_taps_are_those_that_read_the_input_somewhere():
    # DeepLabV3's ASPP on a 14x14 map: dilation 24 or 36 leaves the centre tap alone, 12 all three.
    assert live_taps((14, 14), 3, 1, 24, 24) == (1, 1)
    assert live_taps((14, 14), 3, 1, 36, 36) == (1, 1)
    assert live_taps((14, 14), 3, 1, 12, 12) == (0, 2)
    assert live_taps((56, 28), 3, 2, 1, 1) == (0, 2)  # an ordinary strided conv keeps every tap
    assert live_taps((8, 4), 5, 1, 1, 0) == (0, 4)  # no padding: every tap is in


def _calls_after_layout(model: bytes, bucket: dict, target_dict: dict = TARGET) -> list[relax.Call]:
    """The op calls of ``main`` after the layout stage for ``target_dict``, in order. The weights are
    constants here (the server's are parameters, whose work is lifted out): their transforms are folded,
    as the pipeline's folding stage does."""
    specialized, _ = specialize(onnx.load_from_string(model), bucket, True)
    mod = import_relax(specialized, bucket, {"x": "float32"})
    target = tvm.target.Target(target_dict)
    with target:
        mod = tvm.transform.Sequential(dict(tuned_module_stages(target))["layout"])(mod)
        mod = relax.transform.FoldConstant()(mod)
    bindings = [binding for block in mod["main"].body.blocks for binding in block.bindings]
    return [b.value for b in bindings if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)]


def test_a_pre_activation_batch_norm_keeps_the_blocked_layout():
    """DenseNet's norm between a concat and a conv, as a scale and shift from the weights: ConvertLayout
    carries no blocked layout through ``batch_norm``, which put two transforms of the map around it."""
    ops = [call.op.name for call in _calls_after_layout(convnets.branches_model(), {"x": (2, 3, 56, 56)}, AVX2)]
    assert "relax.nn.batch_norm" not in ops, ops
    # The one into the segmentation head's 4-channel conv, which stays NCHW (the first conv reads the input).
    assert ops.count("relax.layout_transform") == 1, ops


def test_the_first_conv_reads_the_models_input_as_it_comes():
    """The RGB first layer reads NCHW and writes blocks: as one block of 3 channels, a transpose of the
    whole image ran before it on every request."""
    calls = _calls_after_layout(convnets.residual_model(), {"x": (2, 3, 56, 56)}, AVX2)
    first = calls[0]
    assert first.op.name == "relax.nn.conv2d", [call.op.name for call in calls[:3]]
    assert isinstance(first.args[0], relax.Var) and first.args[0].name == "x"
    assert (first.attrs.data_layout, first.attrs.kernel_layout, first.attrs.out_layout) == ("NCHW", "OIHW8o", "NCHW8c")


def _aspp_model() -> bytes:
    """Concat of 3x3 convs with dilation 1, 2, 5 and 8 (padding alike) over a 16-channel 6x6 map, then a
    Relu: dilation 8 reads the input with its centre tap alone, dilation 5 mostly reads padding."""
    rng = np.random.default_rng(3)
    nodes, weights, branches = [], [], []
    for rate in (1, 2, 5, 8):
        weights.append(
            numpy_helper.from_array((rng.standard_normal((16, 16, 3, 3)) * 0.2).astype(np.float32), f"w{rate}")
        )
        nodes.append(helper.make_node("Conv", ["x", f"w{rate}"], [f"c{rate}"], kernel_shape=[3, 3], pads=[rate] * 4,
                                      dilations=[rate, rate]))  # fmt: skip
        branches.append(f"c{rate}")
    nodes += [helper.make_node("Concat", branches, ["cat"], axis=1), helper.make_node("Relu", ["cat"], ["y"])]
    graph = helper.make_graph(nodes, "aspp", [value("x", "float32", ["N", 16, 6, 6])],
                              [value("y", "float32", ["N", 64, 6, 6])], weights)  # fmt: skip
    return make_model(graph).SerializeToString()


def test_tap_bands_group_the_outputs_that_read_the_same_live_taps():
    # DeepLabV3's ASPP conv: 3x3, dilation 12, padding 12, on a 14-wide map.
    assert tap_bands((14, 14), 3, 1, 12, 12) == [(0, 2, 1, 2), (2, 12, 1, 1), (12, 14, 0, 1)]
    assert tap_bands((8, 8), 3, 1, 1, 1) == [(0, 1, 1, 2), (1, 7, 0, 2), (7, 8, 0, 1)]
    assert tap_bands((8, 4), 3, 2, 1, 1) == [(0, 1, 1, 2), (1, 4, 0, 2)]  # stride 2: no tap past the end


def test_a_dilated_conv_drops_the_taps_that_read_only_padding_and_still_verifies(tmp_path):
    """Dilation 8 keeps its centre tap; dilation 5 runs as 3 x 3 bands of output rows and columns, each
    with the taps it reads and no padding (concatenated back); dilations 1 and 2 stay whole."""
    model, bucket = _aspp_model(), {"x": (2, 16, 6, 6)}
    calls = _calls_after_layout(model, bucket)
    kernels = [call.args[1].ty.shape for call in calls if call.op.name == "relax.nn.conv2d"]
    taps = sorted((int(shape[2]), int(shape[3])) for shape in kernels)  # the blocked kernels' kh, kw
    banded = [(1, 1), (1, 2), (1, 2), (2, 1), (2, 1), (2, 2), (2, 2), (2, 2), (2, 2)]
    assert taps == sorted([(1, 1), (3, 3), (3, 3), *banded]), taps
    manifest = compile_bucket(load_model(model, max_bytes=1 << 22), bucket, TARGET, KernelStore(tmp_path)).manifest
    assert manifest.verified, manifest.verification


def test_a_matmul_over_a_batch_of_short_rows_runs_as_one_matmul_over_all_of_them(tmp_path):
    """ConvNeXt's MLP over a 7x7 map (channels last): 7 matmuls of 7 rows, each padded to a whole tile,
    become one of 49 rows (98 at batch 2), which verifies against ONNX Runtime."""
    rng = np.random.default_rng(5)
    weight = numpy_helper.from_array((rng.standard_normal((64, 128)) * 0.1).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Erf", ["m"], ["y"])],
        "mlp", [value("x", "float32", ["N", 7, 7, 64])], [value("y", "float32", ["N", 7, 7, 128])], [weight],
    )  # fmt: skip
    model = make_model(graph).SerializeToString()
    bucket = {"x": (2, 7, 7, 64)}
    products = [  # the data operand of every product by packed panels
        [int(d) for d in call.args[1].fields[0].ty.shape.values]
        for call in _calls_after_layout(model, bucket) if call.op.name == "relax.call_tir"
    ]  # fmt: skip
    assert products == [[98, 64]]
    manifest = compile_bucket(load_model(model, max_bytes=1 << 22), bucket, TARGET, KernelStore(tmp_path)).manifest
    assert manifest.verified, manifest.verification


def test_a_blocked_models_matmul_reads_its_weight_from_column_panels_packed_once():
    """ConvNeXt's MLP weights (K, N) as (N / L, K, L) panels of two vectors, computed in the weight
    transform: in (K, N) a panel's rows lie N floats apart, each a cache miss once the model's weights
    outgrow the L3."""
    from compiler.tvm.schedules.base import vector_lanes

    width = 2 * vector_lanes(tvm.target.Target(TARGET), "float32")
    calls = _calls_after_layout(convnets.convnext_model(), {"x": (2, 3, 56, 56)})
    panels = [
        [int(d) for d in arg.ty.shape.values]
        for call in calls if call.op.name == "relax.call_tir"
        for arg in call.args[1].fields if len(arg.ty.shape.values) == 3
    ]  # fmt: skip
    assert [64 // width, 16, width] in panels, panels  # the 16 -> 64 expansion
    assert not [call for call in calls if call.op.name == "relax.matmul" and call.args[1].ty.shape.values[-1] == 64]


def test_a_classifier_whose_classes_fill_no_whole_panel_gets_a_zero_padded_last_one(tmp_path):
    """A classifier's 1000 classes are 62.5 panels of 16: the last one is padded with zero columns in
    the weight transform and the product is cut back to the classes (the 1 x 1280 x 1000 Gemv ran at
    2x ONNX Runtime's time on weights 1000 floats apart, cold in the cache)."""
    from compiler.tvm.schedules.base import vector_lanes
    from tests.convnets import Net

    width = 2 * vector_lanes(tvm.target.Target(TARGET), "float32")
    net = Net(25)
    features = net.op("Relu", net.conv("x", 3, 16, 3, stride=4))
    model = net.model("classifier", net.classifier(features, 16, classes=40), ["N", 40])
    calls = _calls_after_layout(model, {"x": (1, 3, 56, 56)})
    panels = [
        [int(d) for d in arg.ty.shape.values]
        for call in calls if call.op.name == "relax.call_tir"
        for arg in call.args[1].fields if len(arg.ty.shape.values) == 3
    ]  # fmt: skip
    assert panels == [[-(-40 // width), 16, width]], panels
    store = KernelStore(tmp_path)
    for batch in (1, 2):  # one row (a matrix-vector product) and two
        bucket = {"x": (batch, 3, 56, 56)}
        manifest = compile_bucket(load_model(model, max_bytes=1 << 22), bucket, TARGET, store).manifest
        assert manifest.verified, manifest.verification
        assert manifest.unscheduled == [], manifest.schedules


def test_an_unblocked_models_matmuls_read_panels_and_the_server_holds_the_panels_alone(tmp_path):
    """A model with no convs reads its matmuls' weights from panels too: packed inside the kernel, a panel's
    rows came from K pages of a cold weight at every call (BERT-base 1x128 ran 0.87-0.94x the time from
    panels), and a language model's head (GPT-2's 768 -> 50,257 tokens, no whole number of vectors of
    columns) was copied whole on every call, padded (297 ms of GPT-2's 502 at 1x128, then 92 ms; AMD EPYC
    Zen 3, AVX2). The server gives back the mapped pages of the weights the transform consumed: its pool
    counts the panels, not them as well."""
    from compiler.tvm.schedules.base import vector_lanes

    width = 2 * vector_lanes(tvm.target.Target(TARGET), "float32")
    rng = np.random.default_rng(7)
    hidden = numpy_helper.from_array((rng.standard_normal((64, 128)) * 0.1).astype(np.float32), "hidden")
    head = numpy_helper.from_array((rng.standard_normal((128, 1001)) * 0.1).astype(np.float32), "head")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "hidden"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("MatMul", ["r", "head"], ["y"])],
        "lm", [value("x", "float32", ["N", 8, 64])], [value("y", "float32", ["N", 8, 1001])], [hidden, head],
    )  # fmt: skip
    model = make_model(graph).SerializeToString()
    bucket = {"x": (1, 8, 64)}
    calls = _calls_after_layout(model, bucket)
    panels = [  # the weight operand of every packed product
        [int(d) for d in call.args[1].fields[1].ty.shape.values] for call in calls if call.op.name == "relax.call_tir"
    ]
    assert panels == [[128 // width, 64, width], [-(-1001 // width), 128, width]], panels
    assert not [call for call in calls if call.op.name == "relax.matmul"]
    loaded, store = load_model(model, max_bytes=1 << 22), KernelStore(tmp_path)
    manifest = compile_bucket(loaded, bucket, TARGET, store).manifest
    assert manifest.verified, manifest.verification
    assert manifest.weight_outputs is not None and manifest.unscheduled == [], manifest.schedules
    from server.runtime.memory.kernel_cache import WeightPool, open_tvm_engine

    pool = WeightPool(store)
    assert pool.get(loaded.digest, "llvm").nbytes == (64 * 128 + 128 * 1001) * 4  # mapped, not yet transformed
    weights = pool.get(loaded.digest, "llvm").for_kernel(manifest)
    engine = open_tvm_engine(store.library_path(manifest.key), loaded.signature, TARGET, weights)
    assert pool.total_bytes == sum(count * depth * width * 4 for count, depth, width in panels)
    x = rng.standard_normal(bucket["x"]).astype(np.float32)
    want = np.maximum(x @ numpy_helper.to_array(hidden), 0) @ numpy_helper.to_array(head)
    np.testing.assert_allclose(engine.run({"x": x})["y"], want, rtol=1e-4, atol=1e-4)
    # A weight whose pages were given back still reads the same: they fault in from the file again.
    given_back = dict(zip(manifest.weights, weights, strict=True))
    np.testing.assert_array_equal(given_back["head"].numpy(), numpy_helper.to_array(head))


def test_a_layout_transform_fuses_with_the_transpose_after_it(tmp_path):
    """ConvNeXt's blocked depthwise conv output goes back to NCHW, then to channels last: one kernel, not
    two passes over the map (TVM's own layout transform is an opaque kernel, which FuseOps never fuses)."""
    bucket = {"x": (2, 3, 56, 56)}
    manifest = compile_bucket(load_model(convnets.convnext_model(), max_bytes=1 << 22), bucket, TARGET,
                              KernelStore(tmp_path)).manifest  # fmt: skip
    assert manifest.verified, manifest.verification
    kernels = list(manifest.schedules)
    assert not [name for name in kernels if name.startswith("te_layout_transform")], kernels  # TVM's own
    assert [name for name in kernels if "layout_transform" in name and "transpose" in name], kernels


def test_a_weight_read_by_two_matmuls_is_packed_once(tmp_path):
    """A tied weight (one initializer read by two matmuls, as shared projections are) gets one set of
    panels, which both products read: the server's pool holds one copy of it."""
    from compiler.tvm.schedules.base import vector_lanes
    from server.runtime.memory.kernel_cache import WeightPool, open_tvm_engine

    width = 2 * vector_lanes(tvm.target.Target(TARGET), "float32")
    shared = (np.random.default_rng(9).standard_normal((64, 64)) * 0.1).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Tanh", ["h"], ["t"]),
         helper.make_node("MatMul", ["t", "w"], ["y"])],
        "tied", [value("x", "float32", ["N", 64])], [value("y", "float32", ["N", 64])],
        [numpy_helper.from_array(shared, "w")],
    )  # fmt: skip
    model = make_model(graph).SerializeToString()
    loaded, store = load_model(model, max_bytes=1 << 22), KernelStore(tmp_path)
    manifest = compile_bucket(loaded, {"x": (4, 64)}, TARGET, store).manifest
    assert manifest.verified and manifest.weight_outputs is not None, manifest.verification
    pool = WeightPool(store)
    weights = pool.get(loaded.digest, "llvm").for_kernel(manifest)
    engine = open_tvm_engine(store.library_path(manifest.key), loaded.signature, TARGET, weights)
    assert pool.total_bytes == 64 * 64 * 4 == (64 // width) * 64 * width * 4  # one set of panels, no raw copy
    x = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    np.testing.assert_allclose(engine.run({"x": x})["y"], np.tanh(x @ shared) @ shared, rtol=1e-4, atol=1e-5)


def _conv1d_stem_model() -> bytes:
    """Whisper's audio stem, narrowed: a 3-tap conv1d, then a stride-2 one, and a dilated grouped one with
    uneven padding; a symbolic batch."""
    rng = np.random.default_rng(11)
    weights = {
        "w1": rng.standard_normal((16, 8, 3)).astype(np.float32) * 0.3,
        "w2": rng.standard_normal((16, 16, 3)).astype(np.float32) * 0.3,
        "w3": rng.standard_normal((16, 8, 3)).astype(np.float32) * 0.3,
    }
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"], pads=[1, 1]),
        helper.make_node("Conv", ["a", "w2"], ["b"], pads=[1, 1], strides=[2]),
        helper.make_node("Conv", ["b", "w3"], ["y"], pads=[2, 1], dilations=[2], group=2),
    ]
    graph = helper.make_graph(
        nodes,
        "conv1d_stem",
        [value("x", "float32", ["batch", 8, 60])],
        [value("y", "float32", ["batch", 16, None])],
        [numpy_helper.from_array(w, name) for name, w in weights.items()],
    )
    return make_model(graph).SerializeToString()


def test_a_conv1d_runs_as_a_conv2d_one_row_high_and_verifies(tmp_path):
    """No conv1d is left for the rules (they have no kernel of their own for it); strides, dilation,
    groups and uneven padding carry over, checked against ONNX Runtime."""
    model, bucket = _conv1d_stem_model(), {"x": (2, 8, 60)}
    ops = [call.op.name for call in _calls_after_layout(model, bucket)]
    assert "relax.nn.conv1d" not in ops and ops.count("relax.nn.conv2d") == 3, ops
    manifest = compile_bucket(load_model(model, max_bytes=1 << 22), bucket, TARGET, KernelStore(tmp_path)).manifest
    assert manifest.verified, manifest.verification
