"""The reduced-precision dot-product intrinsics: each one tensorizes a packed matmul into its unit's
instruction, and where this CPU has the unit, answers as numpy does (exactly, for the integer ones, at
the extremes of their operands: where ``vpmaddubsw`` would saturate for the others, at its bound for it)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import s_tir, te

from compiler.building.matrix_units import host_matrix_units, request_amx_permission
from compiler.models.quantized import BYTE_PAIR_BOUND
from compiler.tvm.intrinsics import INTRINSICS, DotIntrinsic, amx_bf16_tile, bf16_to_float32_expr, registered

# A CPU LLVM knows with each unit, for the generated-code checks on a machine without it.
_MCPU = {"avx2": "haswell", "avx-vnni": "alderlake", "avx512-vnni": "cascadelake", "avx512-bf16": "sapphirerapids"}
_M, _PANELS, _STEPS = 6, 3, 40  # rows, weight panels, reduction steps of the intrinsic's depth


def _packed_matmul(intrin: DotIntrinsic, mcpu: str):
    """C[m, n] = sum_k A[m, k] * W[n, k] with W packed in panels of (lanes, depth), tensorized."""
    lanes, depth, acc = intrin.lanes, intrin.depth, intrin.accumulator
    n, k = _PANELS * lanes, _STEPS * depth
    a = te.placeholder((_M, k), intrin.activation, name="A")
    w = te.placeholder((_PANELS, _STEPS, lanes, depth), intrin.weight, name="W")
    r = te.reduce_axis((0, k), name="k")

    def widen(value):
        return bf16_to_float32_expr(value) if acc == "float32" else value.astype(acc)

    c = te.compute(
        (_M, n),
        lambda i, j: te.sum(widen(a[i, r]) * widen(w[j // lanes, r // depth, j % lanes, r % depth]), axis=r),
        name="C",
    )
    sch = s_tir.Schedule(te.create_prim_func([a, w, c]))
    block = sch.get_sblock("C")
    i, j, kk = sch.get_loops(block)
    j_panel, j_lane = sch.split(j, [None, lanes])
    k_step, k_depth = sch.split(kk, [None, depth])
    sch.reorder(i, j_panel, k_step, j_lane, k_depth)
    sch.decompose_reduction(block, k_step)
    sch.tensorize(j_lane, registered(intrin, "global"))
    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu})
    return tvm.tirx.build(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), target)


def _operands(intrin: DotIntrinsic) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(A, W packed, reference C), with a row and a panel at the dtypes' extremes."""
    rng = np.random.default_rng(0)
    n, k = _PANELS * intrin.lanes, _STEPS * intrin.depth
    if intrin.accumulator == "float32":
        a32 = rng.standard_normal((_M, k)).astype(np.float32)
        w32 = rng.standard_normal((n, k)).astype(np.float32)
        a, w = (a32.view(np.uint32) >> 16).astype(np.uint16), (w32.view(np.uint32) >> 16).astype(np.uint16)
        as_float = (a.astype(np.uint32) << 16).view(np.float32)
        ws_float = (w.astype(np.uint32) << 16).view(np.float32)
        reference = (as_float.astype(np.float64) @ ws_float.astype(np.float64).T).astype(np.float32)
    else:
        a = rng.integers(np.iinfo(intrin.activation).min, np.iinfo(intrin.activation).max + 1, (_M, k))
        # int16 weights: int8 ones less their zero point (compiler/tvm/integer_matmul.py), -255..255;
        # vpmaddubsw's: pairs whose parts sum to at most the bound, met exactly by the extremes' pairs
        low, high = {"int16": (-255, 255), "int8": (-128, 127)}[intrin.weight]
        if intrin.instruction == "vpmaddubsw":
            low, high = -BYTE_PAIR_BOUND // 2, BYTE_PAIR_BOUND // 2
        w = rng.integers(low, high + 1, (n, k))
        a[0], w[: intrin.lanes] = np.iinfo(intrin.activation).max, low  # two products overflow int16
        a[1], w[intrin.lanes : 2 * intrin.lanes] = np.iinfo(intrin.activation).min, high
        reference = a @ w.T
        a, w = a.astype(intrin.activation), w.astype(intrin.weight)
    packed = w.reshape(_PANELS, intrin.lanes, _STEPS, intrin.depth).transpose(0, 2, 1, 3).copy()
    return a, packed, reference.astype(intrin.accumulator)


@pytest.mark.parametrize("intrin", INTRINSICS, ids=lambda i: i.name)
def test_each_intrinsic_compiles_to_its_units_instruction(intrin):
    asm = _packed_matmul(intrin, _MCPU[intrin.unit]).inspect_source("asm")
    assert intrin.instruction in asm.split()
    assert "jitserve_dpbf16ps_512" not in asm  # the imported LLVM function is inlined
    # It saturates: only where the weights' pairs were checked to keep its bound.
    assert ("vpmaddubsw" in asm.split()) == (intrin.instruction == "vpmaddubsw")


@pytest.mark.parametrize("intrin", INTRINSICS, ids=lambda i: i.name)
def test_each_intrinsic_answers_as_numpy_where_the_cpu_has_its_unit(intrin):
    units = host_matrix_units()
    if not units.has(intrin.unit):
        pytest.skip(f"this CPU has no {intrin.unit} ({units.describe()}): its code is checked, not run")
    from compiler.building.target import host_cpu

    a, packed, reference = _operands(intrin)
    out = tvm.runtime.tensor(np.zeros(reference.shape, reference.dtype))
    _packed_matmul(intrin, host_cpu())["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(packed), out)
    if intrin.accumulator == "int32":
        np.testing.assert_array_equal(out.numpy(), reference)
    else:
        np.testing.assert_allclose(out.numpy(), reference, rtol=1e-5, atol=1e-4)


def _amx_tiled_matmul(mcpu: str):
    """C[m, n] = sum_k A[m, k] * B[k // 2, n, k % 2] in bf16, tiled 16 x 16 x 32 onto the AMX tile product."""
    m, n, k = 32, 48, 64
    a = te.placeholder((m, k), "uint16", name="A")
    b = te.placeholder((k // 2, n, 2), "uint16", name="B")
    r = te.reduce_axis((0, k), name="k")
    c = te.compute(
        (m, n),
        lambda i, j: te.sum(bf16_to_float32_expr(a[i, r]) * bf16_to_float32_expr(b[r // 2, j, r % 2]), axis=r),
        name="C",
    )
    sch = s_tir.Schedule(te.create_prim_func([a, b, c]))
    block = sch.get_sblock("C")
    i, j, kk = sch.get_loops(block)
    i_tile, i_row = sch.split(i, [None, 16])
    j_tile, j_col = sch.split(j, [None, 16])
    k_tile, k_in = sch.split(kk, [None, 32])
    sch.reorder(i_tile, j_tile, k_tile, i_row, j_col, k_in)
    sch.decompose_reduction(block, k_tile)
    sch.tensorize(i_row, amx_bf16_tile())
    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu})
    return tvm.tirx.build(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), target)


def test_the_amx_bf16_tile_product_compiles_to_tile_instructions():
    words = _amx_tiled_matmul("sapphirerapids").inspect_source("asm").split()
    assert {"ldtilecfg", "tileloadd", "tdpbf16ps", "tilestored"} <= set(words)
    assert "jitserve_tdpbf16ps_16x16x32" not in words  # inlined


def test_the_amx_bf16_tile_product_answers_as_numpy_where_the_cpu_has_amx():
    units = host_matrix_units()
    if not units.has("amx-bf16"):
        pytest.skip(f"this CPU has no AMX ({units.describe()}): its code is checked, not run")
    assert request_amx_permission() is None  # a tile instruction before it is a SIGILL
    from compiler.building.target import host_cpu

    rng = np.random.default_rng(1)
    a32, b32 = rng.standard_normal((32, 64)).astype(np.float32), rng.standard_normal((64, 48)).astype(np.float32)
    a, b = (a32.view(np.uint32) >> 16).astype(np.uint16), (b32.view(np.uint32) >> 16).astype(np.uint16)
    reference = (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64) @ (
        (b.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    )
    packed = b.reshape(32, 2, 48).transpose(0, 2, 1).copy()
    out = tvm.runtime.tensor(np.zeros((32, 48), np.float32))
    _amx_tiled_matmul(host_cpu())["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(packed), out)
    np.testing.assert_allclose(out.numpy(), reference, rtol=1e-5, atol=1e-4)
