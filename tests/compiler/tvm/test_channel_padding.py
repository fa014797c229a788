"""Channels padded up to whole blocks (compiler/tvm/channel_padding.py): which maps are padded and carried,
where the real channels are sliced back, that the rewritten function computes what the original did, and
ragged-width convnets compiled blocked and verified against ONNX Runtime."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from compiler.building.build import compile_bucket
from compiler.building.target import resolve_target
from compiler.models.model import load_model
from compiler.storage.store import KernelStore
from compiler.tvm.channel_padding import pad_channels_to_blocks, padded_channels
from tests import convnets
from tests.convnets import Net

RNG = np.random.default_rng(5)


def _const(*shape: int) -> relax.Expr:
    return relax.const((RNG.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32))


def _block_with(hazard: str | None) -> tvm.IRModule:
    """A MobileNetV3 block on 16 channels with a 24-channel inside (a block of 16 pads it to 32): 1x1
    expand with a bias, hardswish as ``clip`` becomes it (min/max), 3x3 depthwise, squeeze-excitation
    (spatial mean, 1x1 convs, sigmoid gate), 1x1 project, residual add; then ``hazard`` on a padded
    map, a concat and a flatten, which read the channels as they are."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 16, 8, 8), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            e = bb.emit(relax.op.add(relax.op.nn.conv2d(x, _const(24, 16, 1, 1)), _const(1, 24, 1, 1)))
            gate = relax.op.maximum(relax.op.add(e, relax.const(3.0)), relax.const(0.0))
            gate = relax.op.minimum(gate, relax.const(6.0))
            e = bb.emit(relax.op.multiply(e, relax.op.divide(gate, relax.const(6.0))))
            d = bb.emit(relax.op.nn.conv2d(e, _const(24, 1, 3, 3), padding=1, groups=24))
            if hazard == "reciprocal":  # 1 / 0 in the pad channels: sliced back before it
                d = bb.emit(relax.op.divide(relax.const(1.0), d))
            d = bb.emit(relax.op.nn.relu(d))
            s = bb.emit(relax.op.mean(d, axis=[2, 3], keepdims=True))
            s = bb.emit(relax.op.nn.relu(relax.op.nn.conv2d(s, _const(8, 24, 1, 1))))
            s = bb.emit(relax.op.sigmoid(relax.op.nn.conv2d(s, _const(24, 8, 1, 1))))
            d = bb.emit(relax.op.multiply(d, s))
            if hazard == "channel_varying":  # a per-position, all-channel operand: no one pad value
                d = bb.emit(relax.op.multiply(d, relax.op.mean(x, axis=[1], keepdims=True)))
            y = bb.emit(relax.op.add(relax.op.nn.conv2d(d, _const(16, 24, 1, 1)), x))
            both = bb.emit(relax.op.concat([y, d], axis=1))
            out = bb.emit_output(relax.op.reshape(both, (1, 40 * 64)))
        bb.emit_func_output(out)
    return relax.transform.Normalize()(bb.get())


def _run(mod: tvm.IRModule, x: np.ndarray) -> np.ndarray:
    executable = tvm.compile(relax.transform.LegalizeOps()(mod), "llvm")
    vm = relax.VirtualMachine(executable, tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x)).numpy()


@pytest.mark.parametrize(("channels", "block", "padded"), [(24, 16, 32), (40, 16, 48), (184, 16, 192), (12, 8, 16),
                                                          (8, 16, 8), (3, 16, 3), (64, 16, 64)])  # fmt: skip
def test_channels_are_padded_to_whole_blocks_where_the_pad_costs_at_most_half_again(channels, block, padded):
    assert padded_channels(channels, block) == padded


@pytest.mark.parametrize("hazard", [None, "reciprocal", "channel_varying"])
def test_the_padded_function_computes_what_the_original_did(hazard):
    mod = _block_with(hazard)
    padded = relax.transform.Normalize()(pad_channels_to_blocks(mod, 16))
    assert padded["main"].body.body.ty.shape.values[1] == 40 * 64  # the outputs keep their shape
    slices = len(_calls(padded, "relax.strided_slice"))
    # The 24-channel expand, depthwise and gate convs run on 32; the weights gain zero channels.
    conv_channels = sorted(
        int(c.ty.shape.values[1])
        for c in _calls(padded, "relax.nn.conv2d")
        if int(c.ty.shape.values[2]) == 8 and int(c.ty.shape.values[1]) != 16
    )
    assert conv_channels == [32, 32]
    projection = [c for c in _calls(padded, "relax.nn.conv2d") if int(c.ty.shape.values[1]) == 16]
    if hazard is None:
        # Carried to the projection, whose weights gain zero input channels; sliced once, for the concat.
        assert int(projection[-1].args[0].ty.shape.values[1]) == 32 and slices == 1
    else:
        # Sliced back in front of the op that would make the pad channels infinite or not one known value
        # (and the gate before the multiply by the sliced map): the projection reads the 24 real channels.
        assert int(projection[-1].args[0].ty.shape.values[1]) == 24
        assert slices == {"reciprocal": 2, "channel_varying": 1}[hazard]
    x = RNG.standard_normal((1, 16, 8, 8)).astype(np.float32)
    expected, got = _run(mod, x), _run(padded, x)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def _calls(mod: tvm.IRModule, op: str) -> list[relax.Call]:
    calls: list[relax.Call] = []

    def visit(expr) -> None:
        if isinstance(expr, relax.Call) and getattr(expr.op, "name", "") == op:
            calls.append(expr)

    relax.analysis.post_order_visit(mod["main"], visit)
    return calls


@pytest.mark.parametrize("build", [convnets.mobile_model, convnets.residual_model], ids=["mobile", "residual"])
def test_convnets_of_ragged_widths_compile_every_conv_blocked_and_verify(tmp_path, build):
    """Width 12: channels of 12, 24 and 48, which fill no 16-lane block (12 and 24) or no 8-lane one (12):
    each is padded, so every conv but none runs blocked, and the answers match ONNX Runtime's."""
    model = load_model(build(width=12), max_bytes=1 << 24)
    manifest = compile_bucket(model, {"x": (1, 3, 56, 56)}, resolve_target("llvm"), KernelStore(tmp_path)).manifest
    assert manifest.verified, manifest.verification
    convs = [name for name in manifest.schedules if "conv2d" in name]
    assert convs and all("conv2d_nchwc" in name for name in convs), convs


def _grouped(stride: int) -> tvm.IRModule:
    """A 3x3 conv of 32 channels in 8 groups of 4 (ResNeXt's first stage has 32 groups of 4)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 32, 12, 12), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, _const(32, 4, 3, 3), strides=stride, padding=1, groups=8))
            out = bb.emit_output(relax.op.nn.relu(y))
        bb.emit_func_output(out)
    return relax.transform.Normalize()(bb.get())


@pytest.mark.parametrize("block", [8, 16])
def test_a_strided_conv_of_narrow_groups_runs_with_block_wide_groups_its_weights_block_diagonal(block):
    mod = _grouped(stride=2)
    widened = relax.transform.Normalize()(pad_channels_to_blocks(mod, block))
    (conv,) = _calls(widened, "relax.nn.conv2d")
    assert int(conv.attrs.groups) == 32 // block and [int(d) for d in conv.args[1].ty.shape.values] == [32, block, 3, 3]
    x = RNG.standard_normal((1, 32, 12, 12)).astype(np.float32)
    np.testing.assert_allclose(_run(widened, x), _run(mod, x), rtol=1e-4, atol=1e-5)
    # At stride 1 its rows are read whole: it stays as it is (NCHW, no extra multiply-adds).
    (conv,) = _calls(relax.transform.Normalize()(pad_channels_to_blocks(_grouped(stride=1), block)), "relax.nn.conv2d")
    assert int(conv.attrs.groups) == 8


def test_a_net_with_a_strided_conv_of_narrow_groups_compiles_it_blocked_and_verifies(tmp_path):
    n = Net(31)
    x = n.op("Relu", n.conv("x", 3, 32, 3, stride=2))
    x = n.op("Relu", n.conv(x, 32, 32, 3, stride=2, group=8))
    x = n.op("Relu", n.conv(x, 32, 64, 1))
    model = load_model(n.model("narrow_groups", n.classifier(x, 64), ["N", 10]), max_bytes=1 << 24)
    manifest = compile_bucket(model, {"x": (2, 3, 56, 56)}, resolve_target("llvm"), KernelStore(tmp_path)).manifest
    assert manifest.verified, manifest.verification
    convs = [name for name in manifest.schedules if "conv2d" in name]
    assert convs and all("conv2d_nchwc" in name for name in convs), convs


def test_an_operand_of_more_axes_gets_the_real_channels_as_they_are():
    """A per-channel constant of 5 axes, broadcast against the padded NCHW map, would put the channels on
    the result's third axis: the map is sliced back first, and the function computes what it did."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 16, 6, 6), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, _const(24, 16, 1, 1)))
            z = bb.emit(relax.op.multiply(y, _const(1, 1, 24, 1, 1)))
            out = bb.emit_output(relax.op.reshape(z, (1, 24 * 36)))
        bb.emit_func_output(out)
    mod = relax.transform.Normalize()(bb.get())
    padded = relax.transform.Normalize()(pad_channels_to_blocks(mod, 16))
    assert [int(c.ty.shape.values[1]) for c in _calls(padded, "relax.nn.conv2d")] == [32]
    assert len(_calls(padded, "relax.strided_slice")) == 1
    x = RNG.standard_normal((1, 16, 6, 6)).astype(np.float32)
    np.testing.assert_allclose(_run(padded, x), _run(mod, x), rtol=1e-4, atol=1e-5)
