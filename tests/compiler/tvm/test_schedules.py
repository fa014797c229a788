"""Default CPU schedule rules: each matches its family of fused kernels, schedules
it (vectorized, parallel when large), and the compiled model still matches ONNX Runtime."""

from __future__ import annotations

import math
import re

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from compiler.building.build import compile_bucket
from compiler.building.target import resolve_target
from compiler.models.model import load_model
from compiler.storage.store import KernelStore
from tests import synthetic
from tests.synthetic import make_model, value

tvm = pytest.importorskip("tvm")

from tvm.s_tir import dlight as dl  # noqa: E402

from compiler.tvm import schedules as cpu_schedules  # noqa: E402
from compiler.tvm.build import import_relax, specialize  # noqa: E402
from compiler.tvm.pipeline import TUNING_RECORD, default_schedule_pass, tuned_module_stages  # noqa: E402
from compiler.tvm.schedules.base import vector_lanes, vector_unit  # noqa: E402
from compiler.tvm.schedules.register_tile import best_outer_tile, fits_registers, padded_conv_width  # noqa: E402

TARGET = resolve_target("llvm")
RNG = np.random.default_rng(7)


def _const(name: str, shape: tuple[int, ...], scale: float = 0.5) -> onnx.TensorProto:
    return numpy_helper.from_array((RNG.standard_normal(shape) * scale).astype(np.float32), name)


def _model(nodes, x_dims, y_dims, initializer=()) -> bytes:
    graph = helper.make_graph(
        nodes,
        "cpu_schedules",
        [value("x", "float32", x_dims)],
        [value("y", "float32", y_dims)],
        initializer=list(initializer),
    )
    return make_model(graph).SerializeToString()


def _elementwise_model() -> bytes:
    """Add, Mul, Erf (GELU-like), Sigmoid, Transpose over [batch, 6, 40]."""
    nodes = [
        helper.make_node("Add", ["x", "b"], ["t0"]),
        helper.make_node("Erf", ["t0"], ["t1"]),
        helper.make_node("Mul", ["t0", "t1"], ["t2"]),
        helper.make_node("Sigmoid", ["t2"], ["t3"]),
        helper.make_node("Exp", ["t3"], ["t4"]),
        helper.make_node("Transpose", ["t4"], ["y"], perm=[0, 2, 1]),
    ]
    return _model(nodes, ["batch", 6, 40], ["batch", 40, 6], [_const("b", (40,))])


def _matmul_model(k: int = 64, n: int = 48, rows: int | str = 16, *, weight_input: bool = False) -> bytes:
    """Relu(x @ W + b) over [batch, 16, k]. With ``weight_input`` W is the model's second input, computed per
    request as far as the compiler knows: the kernel reads it as it is, where a model's own weight is read
    from panels packed once in the weight transform (``compiler/tvm/panels.py``)."""
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["mm"]),
        helper.make_node("Add", ["mm", "b"], ["z"]),
        helper.make_node("Relu", ["z"], ["y"]),
    ]
    if not weight_input:
        return _model(nodes, ["batch", rows, k], ["batch", rows, n], [_const("W", (k, n), 0.2), _const("b", (n,))])
    graph = helper.make_graph(
        nodes, "cpu_schedules", [value("x", "float32", ["batch", rows, k]), value("W", "float32", [k, n])],
        [value("y", "float32", ["batch", rows, n])], initializer=[_const("b", (n,))],
    )  # fmt: skip
    return make_model(graph).SerializeToString()


def _conv_bn_relu_model(width: int | str = 32) -> bytes:
    """3x3 conv (padding 1) -> BatchNormalization -> Relu, 8 -> 16 channels."""
    c, f = 8, 16
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["conv"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["conv", "scale", "bias", "mean", "var"], ["bn"]),
        helper.make_node("Relu", ["bn"], ["y"]),
    ]
    inits = [
        _const("W", (f, c, 3, 3), 0.2),
        _const("scale", (f,)),
        _const("bias", (f,)),
        _const("mean", (f,)),
        numpy_helper.from_array((RNG.random(f) + 0.5).astype(np.float32), "var"),
    ]
    return _model(nodes, ["batch", c, 12, width], ["batch", f, 12, width], inits)


def _depthwise_model(width: int | str = 32) -> bytes:
    """Depthwise 5x5 conv (padding 2) + bias -> HardSwish, 8 channels."""
    c = 8
    nodes = [
        helper.make_node("Conv", ["x", "W", "b"], ["conv"], kernel_shape=[5, 5], pads=[2, 2, 2, 2], group=c),
        helper.make_node("HardSwish", ["conv"], ["y"]),
    ]
    inits = [_const("W", (c, 1, 5, 5), 0.3), _const("b", (c,))]
    return _model(nodes, ["batch", c, 6, width], ["batch", c, 6, width], inits)


def _softmax_model(width: int | str = 64) -> bytes:
    return _model([helper.make_node("Softmax", ["x"], ["y"], axis=-1)], ["batch", 8, width], ["batch", 8, width])


def _layer_norm_model() -> bytes:
    nodes = [helper.make_node("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1)]
    return _model(nodes, ["batch", 8, 64], ["batch", 8, 64], [_const("g", (64,)), _const("b", (64,))])


def _pooling_model() -> bytes:
    """MaxPool 2x2 / 2, then x * GlobalAveragePool (a squeeze-excite style broadcast)."""
    nodes = [
        helper.make_node("MaxPool", ["x"], ["pool"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("GlobalAveragePool", ["pool"], ["gap"]),
        helper.make_node("Mul", ["pool", "gap"], ["y"]),
    ]
    return _model(nodes, ["batch", 8, 8, 64], ["batch", 8, 4, 32])


def _conv_transpose_model(kernel: int = 2, stride: int = 2, pad: int = 0) -> bytes:
    """Sigmoid(ConvTranspose(x) + b): 6 -> 4 channels; kernel == stride is a 2x upsampling."""
    nodes = [
        helper.make_node(
            "ConvTranspose", ["x", "w", "b"], ["t"], kernel_shape=[kernel] * 2, strides=[stride] * 2, pads=[pad] * 4
        ),
        helper.make_node("Sigmoid", ["t"], ["y"]),
    ]
    weights = [_const("w", (6, 4, kernel, kernel)), _const("b", (4,))]
    return _model(nodes, ["batch", 6, 10, 24], ["batch", 4, "h", "w"], weights)


def _pointwise_model(width: int = 20, channels: int = 10) -> bytes:
    """HardSigmoid(Conv1x1(x) + b) + x: a detector's late, small-map stage. 10 channels fill no channel
    block (of 8 or 16), nor pad to one for less than half again: the conv stays NCHW, a matmul over the
    flattened map."""
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["t"], kernel_shape=[1, 1]),
        helper.make_node("HardSigmoid", ["t"], ["s"]),
        helper.make_node("Add", ["s", "x"], ["y"]),
    ]
    weights = [_const("w", (channels, channels, 1, 1)), _const("b", (channels,))]
    return _model(nodes, ["batch", channels, 20, width], ["batch", channels, 20, width], weights)


def _blocked_conv_model(group: int = 1, channels: int = 32, size: int = 14, height: int | None = None) -> bytes:
    """Relu(Conv3x3(x) + b + x), 32 -> 32 channels on a 14x14 map (its rows fill no two vectors; ``height``
    rows where given): a channel-blocked conv, with the residual add in its epilogue; ``group=32``:
    depthwise."""
    c, rows = channels, height or size
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["t"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=group),
        helper.make_node("Add", ["t", "x"], ["s"]),
        helper.make_node("Relu", ["s"], ["y"]),
    ]
    weights = [_const("w", (c, c // group, 3, 3), 0.1), _const("b", (c,))]
    return _model(nodes, ["batch", c, rows, size], ["batch", c, rows, size], weights)


# (model, bucket, {kernel name fragment: rule expected to schedule it})
CASES = {
    "elementwise": (_elementwise_model, {"x": (2, 6, 40)}, {"erf": "Injective"}),
    "matmul_bias_relu": (_matmul_model, {"x": (2, 16, 64)}, {"matmul": "Contraction"}),
    "matmul_padded_axis": (lambda: _matmul_model(32, 50), {"x": (1, 16, 32)}, {"matmul": "Contraction"}),
    # A one-row product by a matrix the kernel reads as it is, and by a weight it reads from panels.
    # 48 columns: whole vectors of AVX2 (8 lanes) and of AVX-512 (16), which Gemv needs.
    "classifier_gemv": (
        lambda: _matmul_model(256, 48, rows=1, weight_input=True),
        {"x": (1, 1, 256), "W": (256, 48)},
        {"matmul": "Gemv"},
    ),
    "classifier_from_panels": (lambda: _matmul_model(256, 40, rows=1), {"x": (1, 1, 256)}, {"matmul": "Contraction"}),
    "conv_bn_relu": (_conv_bn_relu_model, {"x": (1, 8, 12, 32)}, {"conv2d": "Contraction"}),
    "depthwise_conv": (_depthwise_model, {"x": (2, 8, 6, 32)}, {"conv2d": "Contraction"}),
    "upsampling_conv_transpose": (
        _conv_transpose_model,
        {"x": (2, 6, 10, 24)},
        {"conv2d_transpose_phases": "Contraction", "conv2d_transpose_interleave": "Injective"},
    ),
    "flattened_pointwise_conv": (_pointwise_model, {"x": (2, 10, 20, 20)}, {"conv2d_pointwise": "Contraction"}),
    # A register tile over output channel blocks and columns (its reduction is 288 long).
    "channel_blocked_conv": (_blocked_conv_model, {"x": (1, 32, 14, 14)}, {"conv2d_nchwc": "Contraction"}),
    "channel_blocked_depthwise_conv": (
        lambda: _blocked_conv_model(group=32),
        {"x": (2, 32, 14, 14)},
        {"conv2d_nchwc": "Contraction"},
    ),
    # Fewer channel blocks than twice the cores: its pad is computed per output row (as the rows it reads).
    "channel_blocked_depthwise_conv_few_blocks": (
        lambda: _blocked_conv_model(group=16, channels=16),
        {"x": (1, 16, 14, 14)},
        {"conv2d_nchwc": "Contraction"},
    ),
    "softmax": (_softmax_model, {"x": (2, 8, 64)}, {"softmax": "RowReduction"}),
    "layer_norm": (_layer_norm_model, {"x": (2, 8, 64)}, {"layer_norm": "RowReduction"}),
    "pooling": (_pooling_model, {"x": (1, 8, 8, 64)}, {"max_pool2d": "Contraction", "mean": "RowReduction"}),
}


def _fused_kernels(
    model: bytes, bucket: dict, bounds: dict | None = None, *, mcpu: str | None = None
) -> dict[str, tvm.tirx.PrimFunc]:
    specialized, _ = specialize(onnx.load_from_string(model), bucket, True)
    mod = import_relax(specialized, bucket, dict.fromkeys(bucket, "float32"))
    target = tvm.target.Target({**TARGET, "mcpu": mcpu} if mcpu else TARGET)
    with target:
        passes = [p for _, stage in tuned_module_stages(target, bounds) for p in stage]
        mod = tvm.transform.Sequential(passes)(mod)
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}


def _first_match(func, bounds: dict | None = None, *, mcpu: str | None = None) -> tuple[str, str] | None:
    """(rule name, scheduled TVMScript) of the first rule that schedules ``func``; ``mcpu``: the CPU its
    layout was chosen for (the schedule must see the same vector unit)."""
    target = tvm.target.Target({**TARGET, "mcpu": mcpu} if mcpu else TARGET)
    for rule in cpu_schedules.default_cpu_rules(bounds):
        sch = rule.apply(func, target, False)
        if sch is not None:
            return type(rule).__name__, sch.mod["main"].script()
    return None


@pytest.fixture
def store(tmp_path):
    return KernelStore(tmp_path / "kernels")


@pytest.mark.parametrize("case", list(CASES))
def test_rule_schedules_its_kernel_and_model_verifies(case, store):
    build, bucket, expected = CASES[case]
    model = build()
    kernels = _fused_kernels(model, bucket)
    for fragment, rule in expected.items():
        names = [n for n in kernels if fragment in n]
        assert names, f"no fused kernel named *{fragment}* in {sorted(kernels)}"
        for name in names:
            match = _first_match(kernels[name])
            assert match is not None, f"{name}: no rule matched"
            assert match[0] == rule, f"{name}: scheduled by {match[0]}, expected {rule}"
            assert "T.vectorized" in match[1], f"{name}: nothing vectorized"
    outcome = compile_bucket(load_model(model, max_bytes=1 << 20), bucket, TARGET, store)
    assert outcome.manifest.verified is True, outcome.manifest.verification


@pytest.mark.parametrize("case", list(CASES))
def test_rule_schedules_replay_from_their_trace(case):
    """Tuning stores a rule's schedule as a trace; replaying it must give the same kernel."""
    build, bucket, _ = CASES[case]
    target = tvm.target.Target(TARGET)
    for name, func in _fused_kernels(build(), bucket).items():
        for rule in cpu_schedules.default_cpu_rules():
            sch = rule.apply(func, target, False)
            if sch is not None:
                replayed = tvm.s_tir.Schedule(func)
                sch.trace.apply_to_schedule(replayed, remove_postproc=False)
                tvm.ir.assert_structural_equal(replayed.mod, sch.mod)
                break
        else:
            pytest.fail(f"{name}: no rule matched")


def test_a_softmax_row_no_whole_vector_divides_is_computed_in_whole_vectors_then_its_tail(store):
    """Whisper's attention rows are 1,500 long: 4 lanes divide them, 8 do not. Its exp and normalize ran
    on half vectors (the softmax 2x ONNX Runtime's); now they run on whole ones, the last partial vector
    computed after them (here a row of 100 on an AVX2 CPU), and the model verifies."""
    kernels = _fused_kernels(_softmax_model(100), {"x": (2, 8, 100)}, mcpu="haswell")
    func = next(f for name, f in kernels.items() if "softmax" in name)
    target = tvm.target.Target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
    sch = cpu_schedules.RowReduction().apply(func, target, False)
    script = sch.mod["main"].script()
    # exp and normalize: 12 whole vectors, then the last 4 lanes in a loop of their own (a guarded
    # vector loop would run scalar)
    assert len(re.findall(r"in range\(T\.int64\(12\)\):\n\s+for \w+ in T\.vectorized\(T\.int64\(8\)\)", script)) == 2
    assert len(re.findall(r"in T\.vectorized\(T\.int64\(96\), T\.int64\(100\)\)", script)) == 2, script
    replayed = tvm.s_tir.Schedule(func)
    sch.trace.apply_to_schedule(replayed, remove_postproc=False)
    tvm.ir.assert_structural_equal(replayed.mod, sch.mod)
    outcome = compile_bucket(load_model(_softmax_model(100), max_bytes=1 << 20), {"x": (2, 8, 100)}, TARGET, store)
    assert outcome.manifest.verified is True, outcome.manifest.verification


def test_large_matmul_runs_in_parallel():
    kernels = _fused_kernels(_matmul_model(256, 256), {"x": (8, 16, 256)})
    rule, script = _first_match(next(f for n, f in kernels.items() if "matmul" in n))
    assert rule == "Contraction"
    assert "T.parallel" in script and "T.vectorized" in script and "T.unroll" in script


def test_matmul_rows_with_no_divisor_to_fill_a_tile_are_padded_to_whole_tiles_and_verify(store):
    """ConvNeXt's 7x7 stage: 49 rows, whose divisors give a 1-row tile on AVX2's 6-row budget, are
    computed as 50 in 5-row tiles, the matrix (read as it is) packed into column panels; the model verifies."""
    model, bucket = _matmul_model(256, 64, rows=49, weight_input=True), {"x": (1, 49, 256), "W": (256, 64)}
    kernels = _fused_kernels(model, bucket, mcpu="haswell")
    func = next(f for name, f in kernels.items() if "matmul" in name)
    target = tvm.target.Target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
    script = cpu_schedules.Contraction().apply(func, target, False).mod["main"].script()
    assert "matmul_intermediate_pad = T.sblock_alloc_buffer((T.int64(1), T.int64(50), T.int64(64))" in script
    assert "for i1_1 in T.unroll(T.int64(5))" in script
    assert "W_local = T.sblock_alloc_buffer((T.int64(256), T.int64(64))" in script  # the packed panel
    outcome = compile_bucket(load_model(model, max_bytes=1 << 20), bucket, TARGET, store)
    assert outcome.manifest.verified is True, outcome.manifest.verification


def test_a_matmul_over_a_map_packs_one_panel_per_column_tile_shared_by_every_row(store):
    """ConvNeXt's Linear over a [1, 7, 7, C] map: the column tiles are the parallel loop and each packs its
    panel once for all 7 x 7 rows (computed per map row, the whole matrix was copied 7 times a call). The
    map's rows are one axis of 49 (``layout._matmul_rows_flattened``). The matrix is an input here (a
    model's own weight is read from panels packed once in the weight transform)."""
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"])]
    graph = helper.make_graph(
        nodes, "cpu_schedules", [value("x", "float32", ["batch", 7, 7, 256]), value("W", "float32", [256, 512])],
        [value("y", "float32", ["batch", 7, 7, 512])],
    )  # fmt: skip
    model, bucket = make_model(graph).SerializeToString(), {"x": (1, 7, 7, 256), "W": (256, 512)}
    kernels = _fused_kernels(model, bucket, mcpu="haswell")
    func = next(f for name, f in kernels.items() if "matmul" in name)
    target = tvm.target.Target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
    script = cpu_schedules.Contraction().apply(func, target, False).mod["main"].script()
    parallel = next(line.strip() for line in script.splitlines() if "T.parallel" in line)
    assert parallel == "for i1_0 in T.parallel(T.int64(32)):", parallel  # 512 columns / 16
    outcome = compile_bucket(load_model(model, max_bytes=1 << 20), bucket, TARGET, store)
    assert outcome.manifest.verified is True, outcome.manifest.verification


def test_gemv_sums_the_reduction_in_interleaved_parts_and_runs_a_large_matrix_in_parallel():
    """One output row: the reduction's parts accumulate apart (an rfactor block) and fold per column tile;
    a matrix past 1 MiB is split over the cores. A column tile is 8 vectors where the columns allow
    (a matrix row read in whole cache lines: MobileNetV3's 960 x 1280 layer ran 2x faster than in 1-vector
    tiles), else one vector with 8 interleaved parts."""
    lanes = vector_lanes(tvm.target.Target(TARGET), "float32")
    # 5 vectors of columns fill no 2-vector tile: one vector a tile, whichever the vector width.
    for k, n, parallel, columns in ((1024, 256, True, 8 * lanes), (256, 5 * lanes, False, lanes)):
        kernels = _fused_kernels(_matmul_model(k, n, rows=1, weight_input=True), {"x": (1, 1, k), "W": (k, n)})
        rule, script = _first_match(next(f for name, f in kernels.items() if "matmul" in name))
        assert rule == "Gemv"
        assert 'sblock("matmul_rf_update")' in script and f"T.vectorized(T.int64({columns}))" in script
        assert ("T.parallel" in script) == parallel


@pytest.mark.parametrize(("channels", "size"), [(16, 56), (32, 100)], ids=["few-blocks", "large-map"])
def test_a_depthwise_conv_with_few_channel_blocks_pads_the_rows_of_taps_each_output_row_reads(channels, size):
    """MobileNetV3's 16-channel depthwise conv at 112x112, batch 1: two channel blocks cannot keep two
    cores busy, so the parallel loop is channels x rows and each iteration pads the 3 rows it reads
    (the whole padded map, one serial pass up front, took 4.9x ONNX Runtime's time). So too where a
    block's padded map outgrows half of L2 (102 x 102 x 8 floats: 333 KB)."""
    model, lanes = (
        _blocked_conv_model(group=channels, channels=channels, size=size),
        vector_lanes(tvm.target.Target(TARGET), "float32"),
    )
    kernels = _fused_kernels(model, {"x": (1, channels, size, size)})
    rule, script = _first_match(next(f for name, f in kernels.items() if "conv2d_nchwc" in name))
    assert rule == "Contraction"
    lines = script.splitlines()
    parallel = next(i for i, line in enumerate(lines) if "T.parallel" in line)
    assert f"T.parallel(T.int64({channels // lanes * size}))" in lines[parallel], lines[
        parallel
    ]  # channel blocks x rows
    pad = next(i for i, line in enumerate(lines) if 'T.sblock("pad_temp")' in line)
    assert pad > parallel and 'scope="local"' in next(line for line in lines if "pad_temp_local = " in line)
    assert any("T.int64(3)" in line for line in lines[parallel + 1 : pad]), lines[parallel:pad]  # 3 rows


def test_a_grouped_conv_with_packed_weights_pads_the_rows_each_output_row_reads_inside_the_parallel_loop(store):
    """RegNetY's grouped 3x3 conv on its 112x112 map: 16-channel groups read their input by group, so no
    per-channel pad applies, and its pad was one pass over the whole map before the parallel loop (3.3 MB,
    serial). Where a block's map outgrows half of L2 (here 642 x 16 padded pixels, 329 KB) the conv keeps a
    packed weight panel, and under each output row it pads the rows of taps that row reads; it verifies."""
    model, bucket = _blocked_conv_model(group=4, channels=64, height=640), {"x": (1, 64, 640, 14)}
    kernels = _fused_kernels(model, bucket, mcpu="haswell")
    func = next(f for name, f in kernels.items() if "conv2d_nchwc" in name)
    rule, script = _first_match(func, mcpu="haswell")
    assert rule == "Contraction"
    lines = script.splitlines()
    parallel = next(i for i, line in enumerate(lines) if "T.parallel" in line)
    panel = next(i for i, line in enumerate(lines) if "_local = " in line and "pad" not in line)
    pad = next(i for i, line in enumerate(lines) if 'T.sblock("pad_temp")' in line)
    assert pad > parallel and 'scope="local"' in next(line for line in lines if "pad_temp_local = " in line)
    assert panel < pad, "the packed weight panel is the grouped conv's path"
    assert not any('T.sblock("pad_temp_pad_const")' in line for line in lines)  # no separate fill pass
    outcome = compile_bucket(load_model(model, max_bytes=1 << 22), bucket, TARGET, store)
    assert outcome.manifest.verified is True, outcome.manifest.verification


def test_a_grouped_convs_blocks_of_a_group_share_a_register_tile(store):
    """RegNetY's 16-channel groups are 2 channel blocks each, and both read the same input channels. The
    conv iterates its blocks as (group, block within it), so that a tile holds both blocks of a group
    beside 5 columns, each broadcast input value feeding 2 FMAs (a tile held one block, and RegNetY's and
    ResNeXt-50's stride-1 grouped convs ran 1.09-1.24x ONNX Runtime's time; 0.81-1.16x so). The hot loop
    keeps its accumulators in registers, the schedule replays from its trace, and the model verifies."""
    model, bucket = _blocked_conv_model(group=4, channels=64, size=14), {"x": (1, 64, 14, 14)}
    func = next(f for name, f in _fused_kernels(model, bucket, mcpu="haswell").items() if "conv2d_nchwc" in name)
    target = tvm.target.Target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
    sch = cpu_schedules.Contraction().apply(func, target, False)
    script = sch.mod["main"].script()
    blocks = "T.int64(1), T.int64(4), T.int64(2), T.int64(14), T.int64(14), T.int64(8)"  # groups x blocks each
    assert f"conv2d_nchwc_intermediate = T.sblock_alloc_buffer(({blocks}))" in script, script
    assert [int(n) for n in re.findall(r"_init in T\.unroll\(T\.int64\((\d+)\)\)", script)] == [2, 5], script
    assert _fma_loop_stack_traffic(func, "haswell") == (80, 0)  # 2 x 5 accumulators x 8 input lanes
    replayed = tvm.s_tir.Schedule(func)
    sch.trace.apply_to_schedule(replayed, remove_postproc=False)
    tvm.ir.assert_structural_equal(replayed.mod, sch.mod)
    outcome = compile_bucket(load_model(model, max_bytes=1 << 22), bucket, TARGET, store)
    assert outcome.manifest.verified is True, outcome.manifest.verification


def test_a_gate_broadcast_onto_a_map_is_computed_once_per_channel_and_multiplied_in_parallel(store):
    """Squeeze-excitation: the gate's bias and sigmoid are the small conv's epilogue, computed once per
    channel, not again at every position of the map; the multiply is a parallel stage of its own."""
    channels, squeezed = 64, 16
    nodes = [
        helper.make_node("GlobalAveragePool", ["x"], ["pooled"]),
        helper.make_node("Conv", ["pooled", "w1", "b1"], ["squeeze"], kernel_shape=[1, 1]),
        helper.make_node("Relu", ["squeeze"], ["relu"]),
        helper.make_node("Conv", ["relu", "w2", "b2"], ["excite"], kernel_shape=[1, 1]),
        helper.make_node("Sigmoid", ["excite"], ["gate"]),
        helper.make_node("Mul", ["x", "gate"], ["y"]),
    ]
    weights = [
        _const("w1", (squeezed, channels, 1, 1), 0.2),
        _const("b1", (squeezed,)),
        _const("w2", (channels, squeezed, 1, 1), 0.2),
        _const("b2", (channels,)),
    ]
    model = _model(nodes, ["batch", channels, 28, 28], ["batch", channels, 28, 28], weights)
    bucket = {"x": (2, channels, 28, 28)}
    func = next(f for n, f in _fused_kernels(model, bucket).items() if "sigmoid" in n and "multiply" in n)
    sch = cpu_schedules.Contraction().apply(func, tvm.target.Target(TARGET), False)
    assert sch is not None
    multiply = sch.get(sch.get_sblock("T_multiply"))
    assert "T.reinterpret" not in str(multiply.body)  # no sigmoid in it (its NaN test reinterprets)
    loops = sch.get_loops(sch.get_sblock("T_multiply"))
    assert sch.get(loops[0]).kind == tvm.tirx.ForKind.PARALLEL
    outcome = compile_bucket(load_model(model, max_bytes=1 << 20), bucket, TARGET, store)
    assert outcome.manifest.verified is True, outcome.manifest.verification


def test_a_channel_blocked_conv_of_a_million_multiply_adds_runs_in_parallel():
    """MobileNetV3's 1x1 80 -> 184 conv on its 14x14 map (2.9M multiply-adds) ran on one core under the
    4M threshold every contraction had; a channel-blocked conv over a map wider than a pixel takes 1M."""
    kernels = _fused_kernels(_blocked_conv_model(), {"x": (1, 32, 14, 14)}, mcpu="haswell")  # 1.8M
    rule, script = _first_match(next(f for name, f in kernels.items() if "conv2d_nchwc" in name), mcpu="haswell")
    assert rule == "Contraction" and "T.parallel" in script


def test_gemv_over_columns_in_no_whole_cache_lines_takes_line_tiles_the_last_one_guarded():
    """A 1000-class classifier on AVX2 (125 vectors of columns, no whole number of 64-byte lines): with a
    large matrix its column tiles are a line each (2 vectors), the last tile guarded, and it still
    computes x @ W + b right up to where the columns run out."""
    from tvm.driver import build as tvm_build

    k, n = 512, 1000
    target = tvm.target.Target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
    model = _matmul_model(k, n, rows=1, weight_input=True)
    kernels = _fused_kernels(model, {"x": (1, 1, k), "W": (k, n)}, mcpu="haswell")
    func = next(f for name, f in kernels.items() if "matmul" in name)
    sch = cpu_schedules.Gemv().apply(func, target, False)
    assert sch is not None
    script = sch.mod["main"].script()
    assert "T.vectorized(T.int64(16))" in script and "T.where" in script and "T.parallel(T.int64(63))" in script
    lib = tvm_build(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), target=target)
    rng = np.random.default_rng(5)
    x, w, b = (rng.standard_normal(shape).astype(np.float32) for shape in ((1, 1, k), (k, n), (n,)))
    args = [tvm.runtime.tensor(a) for a in (x, w, b, np.zeros((1, 1, n), np.float32))]
    lib["main"](*args)  # the kernel: Relu(x @ W + b)
    np.testing.assert_allclose(args[-1].numpy(), np.maximum(x @ w + b, 0), rtol=1e-4, atol=1e-4)


def test_a_blocked_conv_whose_tile_weights_outgrow_l1_takes_its_reduction_in_chunks_per_row():
    """ResNet-50's 3x3 256-channel conv on its 14x14 map: a tile of 4 channel blocks reads 295 KB of
    weights, so the input channel blocks go outermost and the row's column tiles share each chunk."""
    kernels = _fused_kernels(_blocked_conv_model(channels=256), {"x": (1, 256, 14, 14)}, mcpu="haswell")
    func = next(f for name, f in kernels.items() if "conv2d_nchwc" in name)
    rule, script = _first_match(func, mcpu="haswell")
    assert rule == "Contraction"
    # 32 channel blocks, each a chunk shared by the row's column tiles: two whole tiles of 5 columns, then
    # the last (4 columns) peeled off (4 x 2 tiles over the 14 columns estimated worse than 2 x 5).
    assert "for rco_0 in range(T.int64(32)):" in script, script
    assert "for x_00, rco_1, ry, rx, rci in T.grid(T.int64(2), T.int64(1), T.int64(3), T.int64(3)" in script, script
    assert "for x_01 in range(T.int64(2), T.int64(3)):" in script, script
    fmas, stack = _fma_loop_stack_traffic(func, "haswell")
    assert fmas >= 8 and stack == 0, (fmas, stack)  # the row buffer's tile stays in registers


@pytest.mark.parametrize(
    ("columns", "blocks", "mcpu", "padded"),
    [(7, 64, "haswell", 9), (14, 32, "haswell", 15), (28, 16, "haswell", 30), (56, 8, "haswell", 57),
     (12, 32, "haswell", 12), (20, 8, "haswell", 20), (7, 64, "skylake-avx512", 7), (14, 2, "skylake-avx512", 14)],
)  # fmt: skip
def test_a_blocked_convs_width_is_padded_only_where_a_better_tile_pays_for_the_padding(columns, blocks, mcpu, padded):
    """ResNet's maps (56, 28, 14, 7) have no factor 3: 4 output channel blocks x 3 columns, 12 accumulators,
    fit them padded by a column or two (the 7x7 map by two). A 12-wide map (4 x 3) and a 20-wide one (2 x 5)
    stay as they are, and so does every map on AVX-512, whose 15 accumulators fit 2 x 7."""
    unit = vector_unit(tvm.target.Target({"kind": "llvm", "mcpu": mcpu}))
    assert padded_conv_width(columns, blocks, unit) == padded


def test_a_tile_whose_broadcast_rows_would_not_fit_the_registers_is_not_chosen():
    """2 x 6 on a 12-wide map: 12 accumulators and 6 broadcasts each read by 2 FMAs need 18 of AVX2's 16
    registers (it spilled and ran up to 1.3x the time of 4 x 3); one block by 12 reuses no broadcast and
    fits, and so does MLAS's 3 x 4."""
    haswell = vector_unit(tvm.target.Target({"kind": "llvm", "mcpu": "haswell"}))
    assert not fits_registers(2, 6, haswell.registers) and fits_registers(4, 3, haswell.registers)
    assert fits_registers(1, 12, haswell.registers) and fits_registers(3, 4, haswell.registers)
    assert best_outer_tile(12, 32, haswell)[1:] == (4, 3)


def _strided_conv_onto_7x7_model() -> bytes:
    """Relu(Conv3x3/2(x) + b), 64 -> 64 channels from 14x14 to 7x7 (ResNet's last stage opens so)."""
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["t"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["t"], ["y"]),
    ]
    weights = [_const("w", (64, 64, 3, 3), 0.1), _const("b", (64,))]
    return _model(nodes, ["batch", 64, 14, 14], ["batch", 64, 7, 7], weights)


def _pointwise_7x7_model() -> bytes:
    """Relu(Conv1x1(x) + b), 256 -> 64 channels on a 7x7 map (ResNet-50's last stage: 2048 -> 512)."""
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["t"], kernel_shape=[1, 1]),
        helper.make_node("Relu", ["t"], ["y"]),
    ]
    weights = [_const("w", (64, 256, 1, 1), 0.1), _const("b", (64,))]
    return _model(nodes, ["batch", 256, 7, 7], ["batch", 64, 7, 7], weights)


# (model, bucket, the conv's result buffer, tile, the loop of tiles (the map's columns, or its flattened
# positions), whole tiles, FMAs of the hot loop: the tile's x 8 input lanes)
PARTIAL_TILE_CASES = {
    "3x3-stride-2-on-7-columns": (
        _strided_conv_onto_7x7_model, {"x": (2, 64, 14, 14)}, "T.int64(2), T.int64(8), T.int64(7), T.int64(7)",
        [4, 3], "x", 2, 96,
    ),
    # At batch 8 too, not 8 images a tile (each broadcast from its own image: 1.91x ONNX Runtime's time).
    "3x3-stride-2-on-7-columns-batch-8": (
        _strided_conv_onto_7x7_model, {"x": (8, 64, 14, 14)}, "T.int64(8), T.int64(8), T.int64(7), T.int64(7)",
        [4, 3], "x", 2, 96,
    ),
    "1x1-on-49-positions": (
        _pointwise_7x7_model, {"x": (1, 256, 7, 7)}, "T.int64(1), T.int64(8), T.int64(49)", [2, 5], "ax2", 9, 80
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(PARTIAL_TILE_CASES))
def test_a_tile_that_divides_no_width_computes_the_exact_width_its_last_tile_peeled(case, store):
    """A 7-wide map has no divisor for a good tile (1 block x 7 columns, at an FMA's latency). The conv is
    computed on its exact width with 4 x 3 tiles (over the 49 positions of the flattened 7x7 map, 2 x 5),
    the last tile partial: peeled off the loop of whole tiles, so neither loop tests a column inside the
    accumulation (the hot loop is the whole tile's FMAs, unbroken), and no padded column is computed
    (padded to 9 columns, ResNet-50's 7x7 convs ran 1.2-1.3x ONNX Runtime's time). The schedule replays
    from its trace, and the model verifies."""
    build, bucket, buffer, tile, axis, whole, fmas = PARTIAL_TILE_CASES[case]
    kernels = _fused_kernels(build(), bucket, mcpu="haswell")
    func = next(f for name, f in kernels.items() if "conv2d_nchwc" in name)
    target = tvm.target.Target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
    sch = cpu_schedules.Contraction().apply(func, target, False)
    script = sch.mod["main"].script()
    assert f"conv2d_nchwc_intermediate = T.sblock_alloc_buffer(({buffer}, T.int64(8)))" in script, script
    assert [int(n) for n in re.findall(r"_init in T\.unroll\(T\.int64\((\d+)\)\)", script)] == tile
    whole_tiles, last_tile = (re.findall(rf"for {axis}_0{part}\b.*", script) for part in (0, 1))
    assert whole_tiles and f"T.int64({whole})" in whole_tiles[0], script
    assert last_tile == [f"for {last_tile[0].split()[1]} in range(T.int64({whole}), T.int64({whole + 1})):"], script
    assert _fma_loop_stack_traffic(func, "haswell") == (fmas, 0)  # the tile's FMAs x 8 input lanes
    replayed = tvm.s_tir.Schedule(func)
    sch.trace.apply_to_schedule(replayed, remove_postproc=False)
    tvm.ir.assert_structural_equal(replayed.mod, sch.mod)
    outcome = compile_bucket(load_model(build(), max_bytes=1 << 22), bucket, TARGET, store)
    assert outcome.manifest.verified is True, outcome.manifest.verification


def test_a_conv_over_its_input_as_it_is_keeps_a_tile_that_divides_its_width():
    """A 2x2 stride-2 conv without padding onto a 7x7 map (ConvNeXt's downsampling): 4 x 3 tiles with the
    last one partial ran 1.09-1.28x the time of 1 block x 7 columns there, so it keeps 1 x 7 whole."""
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], kernel_shape=[2, 2], strides=[2, 2])]
    weights = [_const("w", (64, 64, 2, 2), 0.1), _const("b", (64,))]
    model = _model(nodes, ["batch", 64, 14, 14], ["batch", 64, 7, 7], weights)
    kernels = _fused_kernels(model, {"x": (1, 64, 14, 14)}, mcpu="haswell")
    func = next(f for name, f in kernels.items() if "conv2d_nchwc" in name)
    target = tvm.target.Target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
    script = cpu_schedules.Contraction().apply(func, target, False).mod["main"].script()
    assert [int(n) for n in re.findall(r"_init in T\.unroll\(T\.int64\((\d+)\)\)", script)] == [7], script
    assert "_partition" not in script


def _pointwise_blocked_model(out_channels: int = 112, size: int = 14) -> bytes:
    """Relu(Conv1x1(x) + b), 64 -> ``out_channels`` on a ``size`` x ``size`` map."""
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["t"], kernel_shape=[1, 1]),
        helper.make_node("Relu", ["t"], ["y"]),
    ]
    weights = [_const("w", (out_channels, 64, 1, 1), 0.1), _const("b", (out_channels,))]
    return _model(nodes, ["batch", 64, size, size], ["batch", out_channels, size, size], weights)


@pytest.mark.parametrize(("size", "flattened"), [(14, True), (28, False)])
def test_a_blocked_pointwise_conv_tiles_its_flattened_map_where_the_width_gives_a_poor_tile(size, flattened, store):
    """14 output channel blocks (EfficientNet's 112 channels) on a 14-wide map: the best tile over the columns
    was 1 block x 7 (an FMA's latency bound); over the 196 positions it is 2 x 4. A 28-wide map's columns
    already give 2 x 4 and stay as they are. Both verify against ONNX Runtime."""
    model = _pointwise_blocked_model(size=size)
    bucket = {"x": (1, 64, size, size)}
    kernels = _fused_kernels(model, bucket, mcpu="haswell")
    func = next(f for name, f in kernels.items() if "conv2d_nchwc" in name)
    target = tvm.target.Target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
    script = cpu_schedules.Contraction().apply(func, target, False).mod["main"].script()
    assert (f"T.int64({size * size}), T.int64(8)))" in script) == flattened, script
    tile = [int(n) for n in re.findall(r"_init in T\.unroll\(T\.int64\((\d+)\)\)", script)]
    assert tile == [2, 4], script  # 2 output channel blocks x 4 positions
    fmas, stack = _fma_loop_stack_traffic(func, "haswell")
    assert fmas >= 8 and stack == 0, (fmas, stack)
    outcome = compile_bucket(load_model(model, max_bytes=1 << 22), bucket, TARGET, store)
    assert outcome.manifest.verified is True, outcome.manifest.verification


def test_a_blocked_convs_pad_computed_up_front_runs_a_row_per_parallel_iteration_in_one_pass(store):
    """A 3x3 conv's pad of a 56x56 map in 4 channel blocks: a row of pixels per parallel iteration, each
    pixel's vector stored whole, in one pass; not a zero fill and then a copy fused down to single pixels
    (a division and a modulo per index every 8 floats: ResNet-50's 56x56 conv ran 1.24x slower)."""
    model, bucket = _blocked_conv_model(channels=32, size=56), {"x": (1, 32, 56, 56)}
    kernels = _fused_kernels(model, bucket, mcpu="haswell")
    func = next(f for name, f in kernels.items() if "conv2d_nchwc" in name)
    target = tvm.target.Target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})
    lines = cpu_schedules.Contraction().apply(func, target, False).mod["main"].script().splitlines()
    pad = next(i for i, line in enumerate(lines) if 'T.sblock("pad_temp' in line)
    assert "pad_temp_pad_const" not in "\n".join(lines)
    assert [line.strip() for line in lines[pad - 3 : pad]] == [
        "for n_c_y_fused in T.parallel(T.int64(232)):",  # 4 channel blocks x 58 padded rows
        "for x in range(T.int64(58)):",  # the 56 columns and 2 of the window
        "for i0 in T.vectorized(T.int64(8)):",
    ]
    outcome = compile_bucket(load_model(model, max_bytes=1 << 22), bucket, TARGET, store)
    assert outcome.manifest.verified is True, outcome.manifest.verification


def test_a_strided_pointwise_conv_reads_a_subsampled_map(store):
    """A 1x1 stride-2 conv over a blocked map (ResNet's downsample shortcut) runs over a dense copy of
    every other pixel: reading the map itself with the stride, ResNet-50's 1024 -> 2048 one ran 2.12 ms
    against ONNX Runtime's 1.43, and 1.44 plus 0.04 for the copy so (AMD EPYC Zen 3, AVX2)."""
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], kernel_shape=[1, 1], strides=[2, 2])]
    weights = [_const("w", (64, 32, 1, 1), 0.1), _const("b", (64,))]
    model, bucket = _model(nodes, ["batch", 32, 14, 14], ["batch", 64, 7, 7], weights), {"x": (2, 32, 14, 14)}
    kernels = _fused_kernels(model, bucket)
    assert any("subsample" in name for name in kernels), sorted(kernels)
    conv = next(f for name, f in kernels.items() if "conv2d_nchwc" in name)
    assert "T.int64(14), T.int64(14)" not in conv.script()  # its input is the 7x7 copy
    outcome = compile_bucket(load_model(model, max_bytes=1 << 22), bucket, TARGET, store)
    assert outcome.manifest.verified is True, outcome.manifest.verification


def test_default_schedule_pass_marks_every_kernel_scheduled_and_records_by_what():
    kernels = _fused_kernels(synthetic.fpn_model(), {"x": (1, 4, 32, 48)})
    tuned = next(iter(kernels))  # as MetaScheduleApplyDatabase leaves a kernel it found a record for
    kernels[tuned] = kernels[tuned].with_attr("tirx.is_scheduled", True)
    mod = tvm.IRModule({tvm.ir.GlobalVar(name): f for name, f in kernels.items()})
    target = tvm.target.Target(TARGET)
    schedules: dict = {}
    with target:
        scheduled = default_schedule_pass(target, schedules=schedules)(mod)
        by_dlight = dl.ApplyDefaultSchedule(*cpu_schedules.default_cpu_rules())(mod)
    for gv, func in scheduled.functions_items():
        assert func.attrs and func.attrs.get("tirx.is_scheduled"), gv.name_hint
        tvm.ir.assert_structural_equal(func, by_dlight[gv.name_hint])  # dlight's pass, with a record
    assert schedules[tuned] == TUNING_RECORD
    assert set(schedules) == set(kernels) and None not in schedules.values()
    assert "Contraction" in schedules.values()


def test_a_kernel_no_rule_takes_is_recorded_as_unscheduled():
    # Kernels that carry a CUDA target: the CPU rules decline every one of them.
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    kernels = _fused_kernels(_softmax_model(), {"x": (2, 8, 64)})
    mod = tvm.IRModule({tvm.ir.GlobalVar(name): f.with_attr("target", cuda) for name, f in kernels.items()})
    schedules: dict = {}
    with tvm.target.Target(TARGET) as target:
        default_schedule_pass(target, schedules=schedules)(mod)
    assert schedules and all(rule is None for rule in schedules.values()), schedules


def test_rules_decline_a_non_llvm_target_and_never_raise():
    kernels = _fused_kernels(_softmax_model(), {"x": (2, 8, 64)})
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    for func in kernels.values():
        for rule in cpu_schedules.default_cpu_rules():
            assert rule.apply(func, cuda, False) is None
            assert rule.apply("not a PrimFunc", tvm.target.Target(TARGET), False) is None


def _unary_kernel(op: str, n: int):
    a = tvm.te.placeholder((n,), "float32", "a")
    fn = getattr(tvm.tirx, op)
    b = tvm.te.compute((n,), lambda i: fn(a[i]), name="b")
    return tvm.te.create_prim_func([a, b])


def test_vectorized_exp_erf_sigmoid_tanh_match_libm_lane_parallel():
    """The polynomial rewrites stay within float32 rounding of libm (the logistic and tanh within ONNX
    Runtime's 2e-7), NaN and infinities included, and their vector code never handles lanes one at a time."""
    n = 4096 + 8
    grid = np.linspace(-95.0, 95.0, n - 8, dtype=np.float32)
    x = np.concatenate([grid, np.float32([np.nan, np.inf, -np.inf, 0.0, -0.0, 88.7, 1e-30, -4.5])])
    for op, reference, atol in (
        ("exp", lambda v: math.exp(v) if v < 89 else math.inf, 1e-7),
        ("erf", math.erf, 1e-7),
        ("sigmoid", lambda v: 1 / (1 + math.exp(-v)) if v > -700 else 0.0, 2e-7),
        ("tanh", math.tanh, 2e-7),
    ):
        raw = tvm.IRModule({"main": _unary_kernel(op, n)})
        func = cpu_schedules.vectorizable_math_pass()(raw)["main"]
        assert f"T.{op}(" in raw["main"].script() and f"T.{op}(" not in func.script()
        rule, script = _first_match(func)
        assert rule == "Injective" and "T.vectorized" in script and f"T.{op}(" not in script
        sch = cpu_schedules.Injective().apply(func, tvm.target.Target(TARGET), False)
        lib = tvm.tirx.build(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), TARGET)
        # A NaN test with tirx.isnan extracts, compares and reinserts each lane (vinsertps, vshufps).
        lane_by_lane = {"vinsertps", "vextractps", "vshufps", "vunpcklps"}
        assert not lane_by_lane & set(lib.inspect_source("asm").split()), op
        out = tvm.runtime.tensor(np.zeros(n, np.float32))
        lib["main"](tvm.runtime.tensor(x), out)
        got = out.numpy()
        with np.errstate(over="ignore"):  # float32 as libm's expf gives it: inf above ~88.72
            want = np.array([reference(float(v)) if not math.isnan(v) else math.nan for v in x]).astype(np.float32)
        finite = np.isfinite(want) & (np.abs(want) > 1e-37)
        np.testing.assert_allclose(got[finite], want[finite], rtol=1e-6, atol=atol, err_msg=op)
        assert np.isnan(got[n - 8]), op
        assert np.array_equal(got[n - 7 : n - 5], want[n - 7 : n - 5]), op


@pytest.mark.parametrize(("exponent", "rewritten"), [(2.0, True), (3.0, True), (2.5, False)])
def test_a_square_or_cube_is_computed_as_products_and_other_powers_are_left_to_libm(exponent, rewritten):
    """A tanh-form GELU's x ** 3: powf is called once per lane; x * x * x vectorizes and agrees to rounding."""
    n = 4096
    a = tvm.te.placeholder((n,), "float32", "a")
    b = tvm.te.compute((n,), lambda i: tvm.tirx.power(a[i], tvm.tirx.const(exponent, "float32")), name="b")
    raw = tvm.IRModule({"main": tvm.te.create_prim_func([a, b])})
    func = cpu_schedules.vectorizable_math_pass()(raw)["main"]
    assert ("T.pow(" not in func.script()) == rewritten
    sch = cpu_schedules.Injective().apply(func, tvm.target.Target(TARGET), False)
    lib = tvm.tirx.build(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), TARGET)
    x = np.linspace(-30.0, 30.0, n, dtype=np.float32)
    out = tvm.runtime.tensor(np.zeros(n, np.float32))
    lib["main"](tvm.runtime.tensor(x), out)
    with np.errstate(invalid="ignore"):  # a negative base to 2.5 is NaN, as powf gives
        want = np.power(x.astype(np.float64), exponent)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-6)


def test_chained_polynomial_math_is_kept_in_stages_not_copied_at_every_load():
    """Each polynomial loads its argument 5 to 7 times: Erf -> Mul -> Sigmoid -> Exp inlined into one
    expression was 1.5 MB of script and 20 s of LLVM. A producer used once (a GELU's erf) is still inlined."""
    target = tvm.target.Target(TARGET)
    chained = next(f for n, f in _fused_kernels(_elementwise_model(), {"x": (2, 6, 40)}).items() if "erf" in n)
    sch = cpu_schedules.Injective().apply(chained, target, False)
    names = [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))]
    assert len(names) == 3, names  # the sigmoid's and the exp's arguments are stages of their own
    assert len(sch.mod["main"].script()) < 50_000
    gelu = [
        helper.make_node("Add", ["x", "b"], ["t0"]),
        helper.make_node("Erf", ["t0"], ["t1"]),
        helper.make_node("Mul", ["t0", "t1"], ["y"]),
    ]
    model = _model(gelu, ["batch", 6, 40], ["batch", 6, 40], [_const("b", (40,))])
    func = next(iter(_fused_kernels(model, {"x": (2, 6, 40)}).values()))
    sch = cpu_schedules.Injective().apply(func, target, False)
    assert len(sch.get_child_blocks(sch.get_sblock("root"))) == 1


@pytest.mark.parametrize(
    ("mcpu", "bits", "registers"),
    [("haswell", 256, 16), ("znver3", 256, 16), ("znver4", 512, 32), ("skylake-avx512", 512, 32), ("x86-64", 128, 16)],
)
def test_vector_unit_comes_from_the_cpu_features_not_llvms_vector_width(mcpu, bits, registers):
    # TVM's llvm_get_vector_width answers 512 for all of these.
    unit = cpu_schedules.base.vector_unit(tvm.target.Target({"kind": "llvm", "mcpu": mcpu}))
    assert (unit.bits, unit.registers) == (bits, registers)
    assert unit.lanes("float32") == bits // 32


def _spilled_vector_stores(func, mcpu: str) -> tuple[int, int, int]:
    """(vector stores to the stack, ymm uses, zmm uses) in the assembly of ``func`` scheduled for ``mcpu``."""

    from tvm.driver import build as tvm_build

    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    sch = cpu_schedules.Contraction().apply(func, target, False)
    assert sch is not None
    lib = tvm_build(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), target=target)
    asm = lib.inspect_source("asm")
    spills = re.findall(r"vmov\w*\s+%[yz]mm\d+, -?\d*\(%rsp\)", asm)
    return len(spills), asm.count("%ymm"), asm.count("%zmm")


def _fma_loop_stack_traffic(func, mcpu: str) -> tuple[int, int]:
    """(FMAs, vector loads or stores on the stack) in the innermost loop holding the FMAs: the reduction
    that must keep its accumulators and operands in registers."""

    from tvm.driver import build as tvm_build

    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    sch = cpu_schedules.Contraction().apply(func, target, False)
    asm = tvm_build(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), target=target)
    lines = asm.inspect_source("asm").splitlines()
    first = next(i for i, line in enumerate(lines) if "vfmadd" in line)
    label = next(i for i in range(first, -1, -1) if re.match(r"\.LBB\w+:", lines[i]))
    back = next(i for i in range(first, len(lines)) if re.search(rf"\sj\w+\s+{lines[label][:-1]}$", lines[i]))
    body = lines[label:back]
    stack = [line for line in body if re.search(r"%[yz]mm\d+.*\(%rsp\)|\(%rsp\).*%[yz]mm", line)]
    return sum("vfmadd" in line for line in body), len(stack)


@pytest.mark.parametrize(
    "model, bucket",
    [(lambda: _matmul_model(256, 256), {"x": (8, 16, 256)}), (_conv_bn_relu_model, {"x": (1, 8, 12, 32)})],
    ids=["matmul", "conv"],
)
def test_avx2_tiles_fit_sixteen_ymm_registers(model, bucket):
    """Compiled for an AVX2 CPU on any machine: 8-lane vectors and a tile that does not spill
    (with 16-lane tiles the matmul stored 48 vectors to the stack)."""
    kernels = _fused_kernels(model(), bucket, mcpu="haswell")
    func = next(f for n, f in kernels.items() if "matmul" in n or "conv2d" in n)
    spills, ymm, zmm = _spilled_vector_stores(func, "haswell")
    assert zmm == 0 and ymm > 0
    assert spills <= 2, f"{spills} vector registers spilled to the stack"


@pytest.mark.parametrize(("mcpu", "block"), [("haswell", 8), ("skylake-avx512", 16)])
def test_a_channel_blocked_conv_is_blocked_by_the_targets_lanes_and_its_tile_does_not_spill(mcpu, block):
    """A 3x3 conv on a 14x14 map, built for each ISA on any machine: blocks of one vector's floats, and a
    register tile of several output channel blocks by several columns that fits the register file."""
    kernels = _fused_kernels(_blocked_conv_model(), {"x": (1, 32, 14, 14)}, mcpu=mcpu)
    func = next(f for n, f in kernels.items() if "conv2d_nchwc" in n)
    assert f'T.int64({block})), "float32")' in func.script()  # ...[..., 14, 14, block] float32 buffers
    _, ymm, zmm = _spilled_vector_stores(func, mcpu)
    assert (zmm > 0) == (block == 16) and ymm + zmm > 0
    fmas, stack = _fma_loop_stack_traffic(func, mcpu)
    assert fmas >= 8 and stack == 0, (fmas, stack)  # several accumulators, none of them spilled


def test_matmul_weight_is_packed_into_column_panels_and_verifies(store):
    """A @ W with row tiles to share it: W's K x nr panel is copied once per column tile (a
    contiguous panel on the stack that every row tile reuses) inside the parallel loop; the model
    still verifies. (W is an input here: a model's own weight is packed once, in the weight transform.)"""
    model, bucket = _matmul_model(256, 256, weight_input=True), {"x": (4, 16, 256), "W": (256, 256)}
    kernels = _fused_kernels(model, bucket)
    func = next(f for n, f in kernels.items() if "matmul" in n)
    target = tvm.target.Target(TARGET)
    sch = cpu_schedules.Contraction().apply(func, target, False)
    blocks = [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))]
    panel_name = next(b for b in blocks if b.endswith("_local"))
    panel = sch.get(sch.get_sblock(panel_name))
    assert [int(d) for d in panel.reads[0].source.shape] == [256, 256]  # W, not the activations
    script = sch.mod["main"].script()
    copy = script.index(f'T.sblock("{panel_name}")')
    assert script.index("T.parallel") < copy < script.index('T.sblock("matmul_update")')
    outcome = compile_bucket(load_model(model, max_bytes=1 << 22), bucket, TARGET, store)
    assert outcome.manifest.verified is True, outcome.manifest.verification


def test_upsampling_conv_transpose_is_a_gemm_per_phase_not_a_convolution_over_zeros():
    """kernel == stride: every output pixel has one input pixel per channel, so the kernel reduces over
    the input channels alone (TOPI's form dilates the input with zeros and reduces over kernel taps too)."""
    kernels = _fused_kernels(_conv_transpose_model(), {"x": (2, 6, 10, 24)})
    assert not any("dilate" in f.script() for f in kernels.values()), sorted(kernels)
    phases = next(f for n, f in kernels.items() if "conv2d_transpose_phases" in n)
    sch = tvm.s_tir.Schedule(phases)
    block = sch.get(sch.get_sblock("conv2d_transpose_phases"))
    reduced = [int(iv.dom.extent) for iv in block.iter_vars if iv.iter_type == tvm.tirx.IterVar.CommReduce]
    assert reduced == [6]  # the input channels, nothing else
    # One MAC per output pixel and input channel.
    assert math.prod(int(iv.dom.extent) for iv in block.iter_vars) == 2 * 4 * 20 * 48 * 6


def test_cuda_keeps_tvms_own_lowering_of_the_convolutions():
    bucket = {"x": (1, 6, 10, 24)}
    specialized, _ = specialize(onnx.load_from_string(_conv_transpose_model()), bucket, True)
    mod = import_relax(specialized, bucket, {"x": "float32"})
    target = tvm.target.Target(resolve_target("cuda"))
    with target:
        stages = tuned_module_stages(target)
        through_legalize = stages[: [name for name, _ in stages].index("legalize") + 1]
        mod = tvm.ir.transform.Sequential([p for _, ps in through_legalize for p in ps])(mod)
    names = [gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert any("conv2d_transpose" in n for n in names) and not any("phases" in n for n in names), names


@pytest.mark.parametrize(("kernel", "stride", "pad"), [(3, 2, 1), (2, 1, 0)])
def test_other_conv_transposes_keep_the_general_lowering_and_verify(kernel, stride, pad, store):
    model = _conv_transpose_model(kernel, stride, pad)
    kernels = _fused_kernels(model, {"x": (1, 6, 10, 24)})
    assert not any("conv2d_transpose_phases" in n for n in kernels), sorted(kernels)
    outcome = compile_bucket(load_model(model, max_bytes=1 << 20), {"x": (1, 6, 10, 24)}, TARGET, store)
    assert outcome.manifest.verified is True, outcome.manifest.verification


def test_pointwise_conv_is_a_matmul_over_the_flattened_map_only_where_its_width_fills_no_vector_tile():
    small = _fused_kernels(_pointwise_model(20), {"x": (1, 10, 20, 20)})
    pointwise = next(f for n, f in small.items() if "conv2d_pointwise" in n)
    sch = tvm.s_tir.Schedule(pointwise)
    block = sch.get(sch.get_sblock("conv2d_pointwise"))
    assert [int(iv.dom.extent) for iv in block.iter_vars] == [1, 10, 400, 10]  # n, o, h*w, input channels
    wide = _fused_kernels(_pointwise_model(64), {"x": (1, 10, 20, 64)})
    assert not any("conv2d_pointwise" in n for n in wide) and any("conv2d" in n for n in wide), sorted(wide)


def _strided_conv_model(width: int | str = 32) -> bytes:
    """3x3 conv, stride 2, padding 1, 4 -> 8 channels, then Relu: a width the kernel sees halved."""
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["t"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["t"], ["y"]),
    ]
    return _model(nodes, ["batch", 4, 10, width], ["batch", 8, 5, "w2"], [_const("w", (8, 4, 3, 3), 0.3)])


# The dynamic tier: (model, bucket with a symbolic dim, {kernel fragment: rule}, verification sizes). The sizes
# leave every remainder class of an 8- and 16-lane tile (0, 1, lanes - 1) on the kernels' vectorized axes.
SYMBOLIC_RANGE = (17, 100)
SYMBOLIC_SIZES = [17, 31, 32, 33, 47, 48, 63, 64, 65, 100]
SYMBOLIC_CASES = {
    "conv_bn_relu": (lambda: _conv_bn_relu_model("w"), {"x": (1, 8, 12, "W")}, {"conv2d": "Contraction"}),
    "depthwise_conv": (lambda: _depthwise_model("w"), {"x": (2, 8, 6, "W")}, {"conv2d": "Contraction"}),
    "strided_conv": (lambda: _strided_conv_model("w"), {"x": (1, 4, 10, "W")}, {"conv2d": "Contraction"}),
    "matmul_rows": (lambda: _matmul_model(rows="m"), {"x": (2, "W", 64)}, {"matmul": "Contraction"}),
    "softmax": (lambda: _softmax_model("w"), {"x": (2, 8, "W")}, {"softmax": "RowReduction"}),
    "elementwise": (_elementwise_model, {"x": ("W", 6, 40)}, {"erf": "Injective"}),
}


@pytest.mark.parametrize("case", list(SYMBOLIC_CASES))
def test_rules_schedule_symbolic_extents_and_every_tail_verifies(case, store):
    """A symbolic dim's loops are tiled and vectorized like a static one's (not left naive); the kernel
    matches ONNX Runtime at sizes that leave each remainder of the vector tiles, and at sizes it was
    not verified at."""
    from compiler.building.build import open_kernel
    from compiler.running.engines import OrtEngine

    build, bucket, expected = SYMBOLIC_CASES[case]
    model = build()
    bounds = {"W": SYMBOLIC_RANGE}
    kernels = _fused_kernels(model, bucket, bounds)
    for fragment, rule in expected.items():
        names = [n for n in kernels if fragment in n]
        assert names, f"no fused kernel named *{fragment}* in {sorted(kernels)}"
        for name in names:
            match = _first_match(kernels[name], bounds)
            assert match is not None, f"{name}: no rule matched"
            assert match[0] == rule, f"{name}: scheduled by {match[0]}, expected {rule}"
            assert "T.vectorized" in match[1], f"{name}: nothing vectorized"
    loaded = load_model(model, max_bytes=1 << 20)
    outcome = compile_bucket(loaded, bucket, TARGET, store, verify_sizes={"W": SYMBOLIC_SIZES})
    assert outcome.manifest.verified is True, outcome.manifest.verification
    kernel, reference = open_kernel(loaded, outcome, store), OrtEngine(model)
    for size in (18, 50, 99):
        shape = tuple(size if d == "W" else d for d in bucket["x"])
        x = {"x": RNG.standard_normal(shape).astype(np.float32)}
        np.testing.assert_allclose(kernel.run(x)["y"], reference.run(x)["y"], rtol=1e-4, atol=1e-4)


def test_a_symbolic_width_conv_accumulates_whole_vector_tiles_without_a_guard():
    """The conv runs on the width rounded up to the vector tile (from a zero-padded input) and cuts back
    in its epilogue: only the stores of the last tile are guarded, not every multiply-add."""
    bounds = {"W": SYMBOLIC_RANGE}
    kernels = _fused_kernels(_conv_bn_relu_model("w"), {"x": (1, 8, 12, "W")}, bounds)
    (name,) = [n for n in kernels if "conv2d" in n]
    assert "conv2d_cut" in kernels[name].script()
    _, scheduled = _first_match(kernels[name], bounds)
    update = scheduled.split('T.sblock("conv2d_nchw_update")')[1].split("T.sblock(")[0]
    assert "T.where" not in update
    assert "T.where" in scheduled  # the epilogue's stores of the last tile


def test_a_stepped_dynamic_axis_compiles_a_detector_neck_for_every_multiple(store):
    """With plain symbolic dims the neck's Add has two shapes TVM cannot prove equal, which the kernel
    checks as it runs (test_dynamic_import.py); with a step of 4 (sizes 4 x count) every level's shape is
    exact. Every kernel is scheduled, the accumulators of a conv whose width may end in a half tile
    (2 x count) stay tile-sized, and the kernel matches ONNX Runtime at even and odd counts, verified or not."""
    from compiler.building.build import open_kernel
    from compiler.running.engines import OrtEngine

    model = synthetic.fpn_model()
    loaded = load_model(model, max_bytes=1 << 20)
    height, width = "H@32..96:4", "W@32..144:4"
    bucket = {"x": (1, 4, height, width)}
    bounds = {height: (8, 24), width: (8, 36)}
    kernels = _fused_kernels(model, bucket, bounds)
    target = tvm.target.Target(TARGET)
    for name, func in kernels.items():
        rules = cpu_schedules.default_cpu_rules(bounds)
        scheduled = next((s for rule in rules if (s := rule.apply(func, target, False))), None)
        assert scheduled is not None, f"{name}: no rule matched"
        if "conv2d_nchw_update" in scheduled.mod.script():
            compacted = tvm.transform.Sequential(
                [
                    tvm.s_tir.transform.LowerInitBlock(),
                    tvm.s_tir.transform.PlanAndUpdateBufferAllocationLocation(),
                    tvm.s_tir.transform.ConvertBlocksToOpaque(),
                    tvm.s_tir.transform.CompactBufferAllocation(),
                ]
            )(scheduled.mod).script()
            allocs = [line.strip() for line in compacted.splitlines() if "alloc_buffer" in line]
            tiles = [line for line in allocs if line.startswith("conv2d_nchw")]  # the accumulators
            assert tiles and all("_32__" not in line for line in tiles), (name, allocs)  # no symbolic dim
    sizes = {height: [32, 36, 64, 96], width: [32, 36, 68, 100, 144]}
    outcome = compile_bucket(loaded, bucket, TARGET, store, verify_sizes=sizes)
    assert outcome.manifest.verified is True, outcome.manifest.verification
    kernel, reference = open_kernel(loaded, outcome, store), OrtEngine(model)
    for h, w in ((40, 52), (92, 140), (32, 44)):
        x = {"x": RNG.standard_normal((1, 4, h, w)).astype(np.float32)}
        np.testing.assert_allclose(kernel.run(x)["y"], reference.run(x)["y"], rtol=1e-4, atol=1e-4)


def test_extent_bounds_are_evaluated_at_the_symbolic_ranges():
    from compiler.tvm.schedules.base import extent_bound, planning_bounds

    width = tvm.tirx.Var("W", "int64")
    with planning_bounds({"W": (48, 800)}):
        assert extent_bound((width - 5) // 8 + 1) == 100
        assert extent_bound(tvm.tirx.IntImm("int64", 7)) == 7
        assert extent_bound(tvm.tirx.Var("H", "int64") + 1) is None  # no range known
    assert extent_bound(width) is None


@pytest.mark.parametrize("mcpu", ["haswell", "skylake-avx512"])
@pytest.mark.parametrize(
    "model, bucket",
    [(lambda: _matmul_model(256, 256), {"x": (8, 16, 256)}), (_conv_bn_relu_model, {"x": (8, 8, 32, 32)})],
    ids=["matmul", "conv"],
)
def test_a_tile_accumulates_on_the_stack_not_in_a_workspace_per_tile(model, bucket, mcpu):
    """TVM lowers a "local" CPU buffer to a TVMBackendAllocWorkspace call and a free at each tile of the
    parallel loop (14% of a 1x1 conv's time); the accumulators are a "global" buffer under 1 KB, which
    stays on the stack: on AVX-512 too, where 16 accumulators would be exactly 1 KB (the matmul's tile
    was 8 rows x 2 vectors). Compiled for each ISA on any machine."""
    from tvm.driver import build as tvm_build

    kernels = _fused_kernels(model(), bucket, mcpu=mcpu)
    func = next(f for name, f in kernels.items() if "matmul" in name or "conv" in name)
    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 2})
    sch = cpu_schedules.Contraction().apply(func, target, False)
    assert "T.parallel" in sch.mod["main"].script()
    lib = tvm_build(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), target=target)
    # Workspace allocations in the IR: ``call ptr %f(i32 1, i32 %dev_id, i64 BYTES, i32 2, i32 32)``.
    sizes = [int(n) for n in re.findall(r"i32 %dev_id, i64 (\d+), i32 2, i32 32\)", lib.inspect_source("ll"))]
    assert all(size > 1024 for size in sizes), sizes  # the panel or pad (16 KB, 15 KB), never a tile


def _window_pool_model() -> bytes:
    """YOLOv8's SPPF pool in miniature: a 5x5, stride-1 MaxPool padded by 2, over the map a 4x4 stride-4
    pool made of x[1, 32, h, w] (its size an expression of h and w, as a backbone's last map is)."""
    nodes = [
        helper.make_node("MaxPool", ["x"], ["t"], kernel_shape=[4, 4], strides=[4, 4]),
        helper.make_node("MaxPool", ["t"], ["y"], kernel_shape=[5, 5], pads=[2, 2, 2, 2]),
    ]
    return _model(nodes, [1, 32, "h", "w"], [1, 32, "h4", "w4"])


def test_a_pool_over_a_symbolic_height_and_width_pads_its_map_up_front(store):
    """Computed per channel inside the tile loops, the pad's region over two symbolic dims is bounded by
    ``max(0, x) - min(0, x)``, and LoopPartition recursed on its guards until the compile crashed
    (SIGSEGV: YOLOv8n at height and width 257..1024). The pad is computed once up front instead; the
    kernel compiles and matches ONNX Runtime, at the sizes verified and others."""
    from compiler.building.build import open_kernel
    from compiler.running.engines import OrtEngine

    height, width = "h@36..128", "w@36..128"
    bucket = {"x": (1, 32, height, width)}
    model = _window_pool_model()
    bounds = {height: (36, 128), width: (36, 128)}
    kernels = _fused_kernels(model, bucket, bounds)
    for name, func in kernels.items():
        match = _first_match(func, bounds)
        assert match is not None and match[0] == "Contraction", (name, match)
        assert "T.max(T.int64(0)" not in match[1], name  # no loop bounded by max(0, x) - min(0, x)
    loaded = load_model(model, max_bytes=1 << 20)
    sizes = {height: [36, 77, 128], width: [128, 36, 100]}
    outcome = compile_bucket(loaded, bucket, TARGET, store, verify_sizes=sizes)
    assert outcome.manifest.verified is True, outcome.manifest.verification
    kernel, reference = open_kernel(loaded, outcome, store), OrtEngine(model)
    for h, w in ((40, 127), (101, 52)):
        x = {"x": RNG.standard_normal((1, 32, h, w)).astype(np.float32)}
        np.testing.assert_allclose(kernel.run(x)["y"], reference.run(x)["y"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("reduce", ["max", "min", "sum"])
def test_a_whole_tensor_reduced_to_one_value_is_reduced_in_vector_partials(reduce):
    """A dynamic quantization's min and max over the whole activation: vector partials folded at the end,
    as numpy answers (the sum within float32's reassociation)."""
    x = tvm.te.placeholder((1, 128, 72), "float32", name="x")
    axes = [tvm.te.reduce_axis((0, n)) for n in (1, 128, 72)]
    combine = {"max": tvm.te.max, "min": tvm.te.min, "sum": tvm.te.sum}[reduce]
    out = tvm.te.compute((), lambda: combine(x[axes[0], axes[1], axes[2]], axis=axes), name=reduce)
    func = tvm.te.create_prim_func([x, out])
    rule, _ = _first_match(func)
    assert rule == "RowReduction"
    target = tvm.target.Target(TARGET)
    sch = cpu_schedules.RowReduction().apply(func, target, False)
    lib = tvm.tirx.build(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), target)
    data = np.random.default_rng(0).standard_normal((1, 128, 72)).astype(np.float32)
    got = tvm.runtime.tensor(np.zeros((), np.float32))
    lib["main"](tvm.runtime.tensor(data), got)
    np.testing.assert_allclose(got.numpy(), getattr(np, reduce)(data), rtol=1e-5)
    vector = {"max": "vmaxps", "min": "vminps", "sum": "vaddps"}[reduce]
    assert re.search(rf"{vector}\s+[^\n]*%[yz]mm", lib.inspect_source("asm")), reduce
