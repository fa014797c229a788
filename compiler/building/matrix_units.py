"""The CPU's units for reduced-precision arithmetic, read from its ``/proc/cpuinfo`` flags, and the AMX
permission a process must ask Linux for before its first tile instruction.

The flags, not the model name, say what a CPU can run: the same Xeon model comes with and without AMX
exposed (``avx512_bf16`` but no ``amx_*``), and there bf16 on AVX512-BF16 alone is slower than fp32
(OpenVINO's bf16 ResNet-50: 51.1 ms against its own f32 32.2 ms). A precision whose unit is missing is
not compiled for at all, and the reason says which flag is missing.
"""

from __future__ import annotations

import ctypes
import errno
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

# Each unit and the flags it needs.
UNIT_FLAGS = {
    "amx-int8": ("amx_tile", "amx_int8"),
    "avx512-vnni": ("avx512f", "avx512_vnni"),
    "avx-vnni": ("avx2", "avx_vnni"),
    # int8 operands widened to int16 and multiplied in pairs (vpmaddwd): exact, never saturating.
    "avx2": ("avx2",),
    "amx-bf16": ("amx_tile", "amx_bf16"),
    "avx512-bf16": ("avx512f", "avx512_bf16"),
}
# Each precision's units, fastest first.
_PRECISION_UNITS = {
    "int8": ("amx-int8", "avx512-vnni", "avx-vnni", "avx2"),
    "bf16": ("amx-bf16", "avx512-bf16"),
}


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of a ``/proc/cpuinfo`` text (its first processor's; all cores share them)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


@dataclass(frozen=True)
class MatrixUnits:
    """What a CPU offers each reduced precision: the fastest unit it has for ``int8`` and ``bf16``."""

    flags: frozenset[str]

    def has(self, unit: str) -> bool:
        return self.flags.issuperset(UNIT_FLAGS[unit])

    def unit(self, precision: str) -> str | None:
        """The fastest unit ``precision`` runs on here (``amx-bf16``, ``avx512-vnni``, ``avx2``...); None
        where the CPU has none that pays."""
        return next((unit for unit in _PRECISION_UNITS.get(precision, ()) if self.has(unit)), None)

    def missing(self, precision: str) -> str | None:
        """Why no kernel is compiled in ``precision`` on this CPU; None where one can be."""
        if precision not in ("int8", "bf16"):
            return f"the compiled tier has no {precision} kernels"
        if self.unit(precision) is not None:
            return None
        wanted = " or ".join("+".join(UNIT_FLAGS[unit]) for unit in _PRECISION_UNITS[precision])
        return f"{precision} kernels need a CPU with {wanted}; this one's flags have none of them"

    def describe(self) -> str:
        """``int8 on avx2, bf16 on none``: for logs, explain reports and the bench."""
        return ", ".join(f"{precision} on {self.unit(precision) or 'none'}" for precision in ("int8", "bf16"))


@lru_cache(maxsize=1)
def host_matrix_units() -> MatrixUnits:
    try:
        return MatrixUnits(cpu_flags(Path("/proc/cpuinfo").read_text()))
    except OSError:
        return MatrixUnits(frozenset())


_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_GET_XCOMP_PERM = 0x1022
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def _arch_prctl(code: int, argument: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    result = libc.syscall(_SYS_ARCH_PRCTL, code, argument)
    return 0 if result == 0 else -ctypes.get_errno()


def amx_permitted() -> bool:
    """Whether Linux lets this process use AMX tile data (it asked, or a library asked for it)."""
    mask = ctypes.c_uint64(0)
    if _arch_prctl(_ARCH_GET_XCOMP_PERM, ctypes.addressof(mask)) != 0:
        return False
    return bool(mask.value & (1 << _XFEATURE_XTILEDATA))


@lru_cache(maxsize=1)
def request_amx_permission() -> str | None:
    """Ask Linux, once per process, for AMX tile data: a tile instruction before that is a ``SIGILL``.
    Every process that runs an AMX kernel (the server, the compile child, a bench) calls this before its
    first one. None once granted; otherwise why not."""
    if "amx_tile" not in host_matrix_units().flags:
        return "this CPU's flags have no amx_tile"
    if os.uname().machine != "x86_64":
        return f"AMX permission is asked on x86-64, not {os.uname().machine}"
    result = _arch_prctl(_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
    if result != 0:
        return f"Linux refused AMX tile data: {errno.errorcode.get(-result, str(-result))}"
    return None
