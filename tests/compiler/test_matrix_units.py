"""The CPU's reduced-precision units, read from its flags (not its model name), and the AMX permission a
process asks Linux for once."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from compiler.building.matrix_units import MatrixUnits, cpu_flags, host_matrix_units

_ZEN3 = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi2"
# The same Xeon model with and without AMX exposed (DESIGN: bf16 pays only with AMX).
_EMERALD_RAPIDS = _ZEN3 + " avx512f avx512bw avx512vl avx512_vnni avx512_bf16 avx_vnni"
_EMERALD_RAPIDS_AMX = _EMERALD_RAPIDS + " amx_bf16 amx_tile amx_int8"


def _units(flags: str) -> MatrixUnits:
    return MatrixUnits(cpu_flags(f"processor\t: 0\nmodel name\t: some cpu\nflags\t\t: {flags}\n"))


def test_each_precision_runs_on_the_fastest_unit_the_flags_show():
    assert (_units(_ZEN3).unit("int8"), _units(_ZEN3).unit("bf16")) == ("avx2", None)
    assert (_units(_EMERALD_RAPIDS).unit("int8"), _units(_EMERALD_RAPIDS).unit("bf16")) == (
        "avx512-vnni",
        "avx512-bf16",
    )
    assert _units(_EMERALD_RAPIDS_AMX).describe() == "int8 on amx-int8, bf16 on amx-bf16"
    assert _units("fpu sse sse2").describe() == "int8 on none, bf16 on none"


def test_a_precision_without_its_unit_says_which_flags_it_needs():
    assert _units(_EMERALD_RAPIDS).missing("bf16") is None
    reason = _units(_ZEN3).missing("bf16")
    assert reason is not None and "amx_tile+amx_bf16" in reason and "avx512f+avx512_bf16" in reason
    assert "avx2" in (_units("fpu sse sse2").missing("int8") or "")
    assert "no f16 kernels" in (_units(_EMERALD_RAPIDS_AMX).missing("f16") or "")


def test_amx_permission_is_asked_once_per_process_and_granted_only_with_amx():
    """In a fresh process: where the CPU has AMX, Linux grants tile data after the first request and a
    second one asks nothing; where it has none, the reason names the flag and Linux itself refuses."""
    script = textwrap.dedent(
        """
        import json
        from compiler.building import matrix_units as m
        before = m.amx_permitted()
        first, second = m.request_amx_permission(), m.request_amx_permission()
        asked = m.request_amx_permission.cache_info().misses
        raw = m._arch_prctl(m._ARCH_REQ_XCOMP_PERM, m._XFEATURE_XTILEDATA)
        print(json.dumps([before, first, second, asked, m.amx_permitted(), raw]))
        """
    )
    before, first, second, asked, after, raw = json.loads(
        subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    )
    assert (second, asked) == (first, 1)
    if "amx_tile" in host_matrix_units().flags:
        assert (first, after, raw) == (None, True, 0)
    else:
        assert first == "this CPU's flags have no amx_tile"
        assert (before, after) == (False, False) and raw < 0
