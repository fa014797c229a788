"""Tensor intrinsics for the CPU's reduced-precision units: int8 and bf16 dot products that a schedule
tensorizes a contraction's innermost tile into.

Each one computes ``C[i] += sum_k A[k] * B[i, k]`` for a vector of ``C`` (int32 or float32) against one
row ``A`` of the activation and a packed panel ``B`` of the weights (``lanes`` output columns by
``depth`` reduction steps, depth innermost, as the weight transform packs them). All are exact in their
accumulator on the weights they are used for.

- ``avx2``: operands widened to int16 and multiplied in pairs (``vpmaddwd``); or, for weights whose
  pairs keep :data:`compiler.models.quantized.BYTE_PAIR_BOUND`, bytes multiplied in pairs into int16
  (``vpmaddubsw``), which saturates on others (two products of 255 x 127 overflow it).
- ``avx-vnni`` / ``avx512-vnni``: ``vpdpbusd``, four u8 x s8 products into each int32 lane, exact on any
  weight (no int16 sum between). TVM 0.27's own ``dot_16x4_vnni`` no longer tensorizes with LLVM 22 (its
  operands are ``<64 x i8>`` now). ``vpdpwssd``: two int16 x int16 products, added in the same
  instruction.
- ``avx512-bf16``: ``vdpbf16ps``, two bf16 products into each float32 lane. bf16 is stored as uint16
  (TVM legalizes bf16 storage to it, and LLVM's intrinsic wants ``<32 x bfloat>``, which TIR cannot
  name after that): the call goes through a two-line LLVM function imported into the module
  (``pragma_import_llvm``) that reinterprets the bits, inlined by LLVM.

- ``amx-bf16``: one AMX tile product (:data:`AMX_BF16_TILE`, ``tdpbf16ps``), 16 x 16 float32 outputs
  of 32 bf16 products each, through an imported LLVM function too (TIR has no tile type).

A bf16 value here is the top half of a float32's bits (:func:`bf16_to_float32_expr`). No kernel uses
the VNNI, bf16 or AMX ones yet: they are checked by the code they compile to.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from tvm.s_tir import TensorIntrin
from tvm.script import tirx as T


@dataclass(frozen=True)
class DotIntrinsic:
    """A registered dot-product intrinsic: ``lanes`` outputs, ``depth`` products summed into each."""

    name: str
    unit: str
    activation: str  # dtype of A
    weight: str  # dtype of B
    accumulator: str  # dtype of C
    lanes: int
    depth: int
    instruction: str
    """What computes it: ``vpmaddwd``, ``vpmaddubsw`` (exact only on weights whose pairs fit, see
    :data:`compiler.models.quantized.BYTE_PAIR_BOUND`), ``vpdpbusd``, ``vdpbf16ps``."""

    def named(self, scope: str) -> str:
        """The name it is registered by for accumulators in ``scope`` (tensorize matches the scope):
        ``global`` for an output, ``local`` for a register tile's."""
        return self.name if scope == "global" else f"{self.name}_{scope}"


def bf16_to_float32_expr(value):
    """A uint16-stored bf16 ``value`` as the float32 it stands for (its bits in the top half)."""
    return T.reinterpret(T.shift_left(T.cast(value, "uint32"), T.uint32(16)), dtype="float32")


def _widen(value, accumulator: str):
    return bf16_to_float32_expr(value) if accumulator == "float32" else T.cast(value, accumulator)


def _desc(intrin: DotIntrinsic, scope: str):
    lanes, depth, acc = intrin.lanes, intrin.depth, intrin.accumulator

    @T.prim_func(s_tir=True)
    def desc(
        A: T.Buffer((depth,), intrin.activation, offset_factor=1),
        B: T.Buffer((lanes, depth), intrin.weight, offset_factor=1),
        C: T.Buffer((lanes,), acc, offset_factor=1, scope=scope),
    ) -> None:
        with T.sblock("root"):
            T.reads(C[0:lanes], A[0:depth], B[0:lanes, 0:depth])
            T.writes(C[0:lanes])
            for i in T.serial(0, lanes):
                for k in T.serial(0, depth):
                    with T.sblock("update"):
                        vi, vk = T.axis.remap("SR", [i, k])
                        C[vi] = C[vi] + _widen(A[vk], acc) * _widen(B[vi, vk], acc)

    return desc


def _avx2_impl(intrin: DotIntrinsic, scope: str):
    """``vpmaddwd`` on int16-widened operands: 8 int32 lanes, 2 products each."""
    activation, weight = intrin.activation, intrin.weight

    @T.prim_func(s_tir=True)
    def impl(
        A: T.Buffer((2,), activation, offset_factor=1),
        B: T.Buffer((8, 2), weight, offset_factor=1),
        C: T.Buffer((8,), "int32", offset_factor=1, scope=scope),
    ) -> None:
        with T.sblock("root"):
            T.reads(C[0:8], A[0:2], B[0:8, 0:2])
            T.writes(C[0:8])
            pair = T.reinterpret(T.cast(A.vload([0], f"{activation}x2"), "int16x2"), dtype="int32")
            C[T.ramp(T.int32(0), 1, 8)] += T.call_llvm_pure_intrin(
                T.llvm_lookup_intrinsic_id("llvm.x86.avx2.pmadd.wd"),
                T.reinterpret(T.broadcast(pair, 8), dtype="int16x16"),
                T.cast(B.vload([0, 0], dtype=f"{weight}x16"), "int16x16"),
                dtype="int32x8",
            )

    return impl


def _avx2_bytes_impl(intrin: DotIntrinsic, scope: str):
    """``vpmaddubsw`` then ``vpmaddwd`` by ones: 8 int32 lanes, 4 uint8 x int8 products each."""

    @T.prim_func(s_tir=True)
    def impl(
        A: T.Buffer((4,), "uint8", offset_factor=1),
        B: T.Buffer((8, 4), "int8", offset_factor=1),
        C: T.Buffer((8,), "int32", offset_factor=1, scope=scope),
    ) -> None:
        with T.sblock("root"):
            T.reads(C[0:8], A[0:4], B[0:8, 0:4])
            T.writes(C[0:8])
            quad = T.reinterpret(A.vload([0], "uint8x4"), dtype="int32")
            pairs = T.call_llvm_pure_intrin(
                T.llvm_lookup_intrinsic_id("llvm.x86.avx2.pmadd.ub.sw"),
                T.reinterpret(T.broadcast(quad, 8), dtype="uint8x32"),
                B.vload([0, 0], dtype="int8x32"),
                dtype="int16x16",
            )
            C[T.ramp(T.int32(0), 1, 8)] += T.call_llvm_pure_intrin(
                T.llvm_lookup_intrinsic_id("llvm.x86.avx2.pmadd.wd"),
                pairs,
                T.broadcast(T.int16(1), 16),
                dtype="int32x8",
            )

    return impl


def _vnni_impl(intrin: DotIntrinsic, scope: str):
    """VNNI's accumulating dot products, ``lanes`` int32 lanes (8 with AVX-VNNI or AVX512-VNNI's VL form,
    16 with AVX512-VNNI): ``vpdpbusd``, 4 u8 x s8 products each; ``vpdpwssd``, 2 int16 x int16 products
    each, added to the accumulator in the same instruction (``vpmaddwd`` needs a ``vpaddd``)."""
    lanes, depth, activation, weight = intrin.lanes, intrin.depth, intrin.activation, intrin.weight
    llvm = f"llvm.x86.avx512.{intrin.instruction}.{lanes * 32}"

    @T.prim_func(s_tir=True)
    def impl(
        A: T.Buffer((depth,), activation, offset_factor=1),
        B: T.Buffer((lanes, depth), weight, offset_factor=1),
        C: T.Buffer((lanes,), "int32", offset_factor=1, scope=scope),
    ) -> None:
        with T.sblock("root"):
            T.reads(C[0:lanes], A[0:depth], B[0:lanes, 0:depth])
            T.writes(C[0:lanes])
            group = T.reinterpret(A.vload([0], f"{activation}x{depth}"), dtype="int32")  # 32 bits of A
            C[T.ramp(T.int32(0), 1, lanes)] = T.call_llvm_pure_intrin(
                T.llvm_lookup_intrinsic_id(llvm),
                C[T.ramp(T.int32(0), 1, lanes)],
                T.reinterpret(T.broadcast(group, lanes), dtype=f"{activation}x{lanes * depth}"),
                B.vload([0, 0], dtype=f"{weight}x{lanes * depth}"),
                dtype=f"int32x{lanes}",
            )

    return impl


_DPBF16PS = """
define internal <16 x float> @jitserve_dpbf16ps_512(<16 x float> %c, <32 x i16> %a, <32 x i16> %b) alwaysinline {
  %a.bf16 = bitcast <32 x i16> %a to <32 x bfloat>
  %b.bf16 = bitcast <32 x i16> %b to <32 x bfloat>
  %r = call <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float> %c, <32 x bfloat> %a.bf16,
                                                          <32 x bfloat> %b.bf16)
  ret <16 x float> %r
}
declare <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float>, <32 x bfloat>, <32 x bfloat>)
"""


def _bf16_impl(intrin: DotIntrinsic, scope: str):
    """``vdpbf16ps``: 16 float32 lanes, 2 bf16 products each."""

    @T.prim_func(s_tir=True)
    def impl(
        A: T.Buffer((2,), "uint16", offset_factor=1),
        B: T.Buffer((16, 2), "uint16", offset_factor=1),
        C: T.Buffer((16,), "float32", offset_factor=1, scope=scope),
    ) -> None:
        with T.sblock("root"):
            T.reads(C[0:16], A[0:2], B[0:16, 0:2])
            T.writes(C[0:16])
            T.attr("", "pragma_import_llvm", _DPBF16PS)
            pair = T.reinterpret(A.vload([0], "uint16x2"), dtype="int32")
            C[T.ramp(T.int32(0), 1, 16)] = T.call_extern(
                "float32x16",
                "jitserve_dpbf16ps_512",
                C[T.ramp(T.int32(0), 1, 16)],
                T.reinterpret(T.broadcast(pair, 16), dtype="uint16x32"),
                B.vload([0, 0], dtype="uint16x32"),
            )

    return impl


AMX_BF16_TILE = "jitserve_tile_16x16x32_bf16_amx"
"""``C[16, 16] += A[16, 32] x B[16, 16, 2]``: float32 accumulators, bf16 operands, ``B`` with pairs of k
innermost (as ``tdpbf16ps`` reads it): one AMX tile product, each operand loaded from its rows' stride.
A process runs it only once Linux granted it AMX tile data
(:func:`compiler.building.matrix_units.request_amx_permission`); LLVM configures the tiles
(``ldtilecfg``) around it."""

_TDPBF16PS = """
define internal void @jitserve_tdpbf16ps_16x16x32(ptr %c, i64 %ldc, ptr %a, i64 %lda, ptr %b, i64 %ldb) alwaysinline {
  %ta = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 64, ptr %a, i64 %lda)
  %tb = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 64, ptr %b, i64 %ldb)
  %tc = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 64, ptr %c, i64 %ldc)
  %td = call x86_amx @llvm.x86.tdpbf16ps.internal(i16 16, i16 64, i16 64, x86_amx %tc, x86_amx %ta, x86_amx %tb)
  call void @llvm.x86.tilestored64.internal(i16 16, i16 64, ptr %c, i64 %ldc, x86_amx %td)
  ret void
}
declare x86_amx @llvm.x86.tileloadd64.internal(i16, i16, ptr, i64)
declare x86_amx @llvm.x86.tdpbf16ps.internal(i16, i16, i16, x86_amx, x86_amx, x86_amx)
declare void @llvm.x86.tilestored64.internal(i16, i16, ptr, i64, x86_amx)
"""


def _amx_bf16_functions():
    """The AMX tile product's description and implementation (parsed when first registered)."""

    @T.prim_func(s_tir=True)
    def _amx_bf16_desc(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (16, 32), "uint16", offset_factor=1)
        B = T.match_buffer(b, (16, 16, 2), "uint16", offset_factor=1)
        C = T.match_buffer(c, (16, 16), "float32", offset_factor=1)
        with T.sblock("root"):
            T.reads(C[0:16, 0:16], A[0:16, 0:32], B[0:16, 0:16, 0:2])
            T.writes(C[0:16, 0:16])
            for i, j, k in T.grid(16, 16, 32):
                with T.sblock("update"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    C[vi, vj] = C[vi, vj] + bf16_to_float32_expr(A[vi, vk]) * bf16_to_float32_expr(
                        B[vk // 2, vj, vk % 2]
                    )

    @T.prim_func(s_tir=True)
    def _amx_bf16_impl(a: T.handle, b: T.handle, c: T.handle) -> None:
        row_a = T.int32()
        row_b = T.int32()
        pair_b = T.int32()
        row_c = T.int32()
        A = T.match_buffer(a, (16, 32), "uint16", strides=[row_a, 1], offset_factor=1)
        B = T.match_buffer(b, (16, 16, 2), "uint16", strides=[row_b, pair_b, 1], offset_factor=1)
        C = T.match_buffer(c, (16, 16), "float32", strides=[row_c, 1], offset_factor=1)
        with T.sblock("root"):
            T.reads(C[0:16, 0:16], A[0:16, 0:32], B[0:16, 0:16, 0:2])
            T.writes(C[0:16, 0:16])
            T.attr("", "pragma_import_llvm", _TDPBF16PS)
            T.evaluate(
                T.call_extern(
                    "void",
                    "jitserve_tdpbf16ps_16x16x32",
                    C.access_ptr("rw"),
                    T.int64(row_c * 4),
                    A.access_ptr("r"),
                    T.int64(row_a * 2),
                    B.access_ptr("r"),
                    T.int64(row_b * 2),
                )
            )

    return _amx_bf16_desc, _amx_bf16_impl


INTRINSICS = (
    DotIntrinsic("jitserve_dot_8x2_u8s8_avx2", "avx2", "uint8", "int8", "int32", 8, 2, "vpmaddwd"),
    DotIntrinsic("jitserve_dot_8x2_s8s8_avx2", "avx2", "int8", "int8", "int32", 8, 2, "vpmaddwd"),
    # Both operands widened ahead, the weights made exact in int16 by subtracting their zero point
    # (compiler/tvm/integer_matmul.py): an activation pair is then one broadcast load.
    DotIntrinsic("jitserve_dot_8x2_s16s16_avx2", "avx2", "int16", "int16", "int32", 8, 2, "vpmaddwd"),
    # Weights whose pairs keep compiler.models.quantized.BYTE_PAIR_BOUND: half the weight bytes, a quarter
    # fewer instructions.
    DotIntrinsic("jitserve_dot_8x4_u8s8_avx2_bounded", "avx2", "uint8", "int8", "int32", 8, 4, "vpmaddubsw"),
    DotIntrinsic("jitserve_dot_8x4_u8s8_avx_vnni", "avx-vnni", "uint8", "int8", "int32", 8, 4, "vpdpbusd"),
    DotIntrinsic("jitserve_dot_16x4_u8s8_avx512_vnni", "avx512-vnni", "uint8", "int8", "int32", 16, 4, "vpdpbusd"),
    # 8 lanes of vpdpbusd on AVX512-VNNI (its VL form): the matmul panels' width. Exact on any weight.
    DotIntrinsic("jitserve_dot_8x4_u8s8_avx512_vnni", "avx512-vnni", "uint8", "int8", "int32", 8, 4, "vpdpbusd"),
    DotIntrinsic("jitserve_dot_8x2_s16s16_avx_vnni", "avx-vnni", "int16", "int16", "int32", 8, 2, "vpdpwssd"),
    DotIntrinsic("jitserve_dot_8x2_s16s16_avx512_vnni", "avx512-vnni", "int16", "int16", "int32", 8, 2, "vpdpwssd"),
    DotIntrinsic("jitserve_dot_16x2_s16s16_avx512_vnni", "avx512-vnni", "int16", "int16", "int32", 16, 2, "vpdpwssd"),
    DotIntrinsic(
        "jitserve_dot_16x2_bf16_avx512_bf16", "avx512-bf16", "uint16", "uint16", "float32", 16, 2, "vdpbf16ps"
    ),
)
_IMPLS = {
    "vpmaddwd": _avx2_impl,
    "vpmaddubsw": _avx2_bytes_impl,
    "vpdpbusd": _vnni_impl,
    "vpdpwssd": _vnni_impl,
    "vdpbf16ps": _bf16_impl,
}


@functools.cache
def registered(intrin: DotIntrinsic, scope: str) -> str:
    """The name ``intrin`` is tensorized by for accumulators in ``scope``, registered on first use: parsing
    every intrinsic's TVMScript at import cost each compile child 8 s."""
    name = intrin.named(scope)
    TensorIntrin.register(name, _desc(intrin, scope), _IMPLS[intrin.instruction](intrin, scope), override=True)
    return name


@functools.cache
def amx_bf16_tile() -> str:
    """:data:`AMX_BF16_TILE`, registered on first use."""
    TensorIntrin.register(AMX_BF16_TILE, *_amx_bf16_functions(), override=True)
    return AMX_BF16_TILE


def dot_intrinsic(unit: str, activation: str, weight: str, depth: int, lanes: int = 8) -> DotIntrinsic | None:
    """The intrinsic for ``unit`` (a :class:`compiler.building.matrix_units.MatrixUnits` unit name) on
    ``activation`` by ``weight`` operands, ``depth`` products into each of ``lanes``; None where there is
    none (the VNNI byte ones take uint8 activations only, and the AMX tiles have no intrinsic here yet)."""
    wanted = (unit, activation, weight, depth, lanes)
    return next((i for i in INTRINSICS if (i.unit, i.activation, i.weight, i.depth, i.lanes) == wanted), None)


# The units a target's LLVM features name, fastest first for int8 (AVX512-VNNI's 8-lane forms need AVX512VL).
_TARGET_UNITS = (
    ("avx512-vnni", ("avx512vnni", "avx512vl")),
    ("avx-vnni", ("avxvnni",)),
    ("avx512-bf16", ("avx512bf16",)),
    ("avx2", ("avx2",)),
)
VNNI_UNITS = ("avx512-vnni", "avx-vnni")
"""The units whose byte products sum into int32 exactly (``vpdpbusd``), on any int8 weight."""


def target_units(target) -> list[str]:
    """The reduced-precision units ``target`` has (:data:`INTRINSICS`' unit names), fastest first."""
    from tvm.target.codegen import llvm_cpu_has_features

    return [unit for unit, features in _TARGET_UNITS if all(llvm_cpu_has_features(f, target) for f in features)]


def best_dot_intrinsic(target, activation: str, weight: str, depth: int, lanes: tuple[int, ...] = (8,)):
    """The fastest intrinsic ``target`` runs for these operands, the widest of ``lanes`` first; None where none."""
    for unit in target_units(target):
        for width in sorted(lanes, reverse=True):
            intrin = dot_intrinsic(unit, activation, weight, depth, width)
            if intrin is not None:
                return intrin
    return None
