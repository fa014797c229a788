"""Tuning over the rules' knobs: candidates that compute what the default computes, a search that never
swaps the default for a slower schedule, and the shipped database used only on the ISA and core count it
was tuned for."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import te
from tvm.s_tir import meta_schedule as ms

from compiler.tvm.knob_search import knob_candidates, schedule_with
from compiler.tvm.schedules.knobs import choose, knob_session
from compiler.tvm.tuning import TuningRun
from compiler.tvm.tuning_database import (
    isa_key,
    merge_into_shared,
    open_shared_database,
    records_of,
    shipped_path,
    write_shipped,
)

AVX2_2 = {"kind": "llvm", "mcpu": "haswell", "num-cores": 2}


def pointwise_conv(channels: int = 116, positions: int = 196):
    """ShuffleNetV2's 1x1 conv on its 14x14 map as the rules see it: (O x C) @ (C x HW), 196 columns that
    only half vectors divide."""
    x = te.placeholder((1, channels, positions), name="x")
    w = te.placeholder((channels, channels), name="w")
    c = te.reduce_axis((0, channels), name="c")
    y = te.compute((1, channels, positions), lambda n, o, f: te.sum(x[n, c, f] * w[o, c], axis=c), name="y")
    return te.create_prim_func([x, w, y])


def run(func, target, arrays: list[np.ndarray]) -> np.ndarray:
    library = tvm.compile(tvm.IRModule({"main": func}), target=target)
    device = tvm.cpu()
    buffers = [tvm.runtime.tensor(a, device) for a in arrays]
    library["main"](*buffers)
    return buffers[-1].numpy()


def test_a_knob_outside_a_session_or_its_alternatives_is_the_rules_choice():
    assert choose("contraction.parallel", True, (False,)) is True
    with knob_session({"contraction.nr": 5, "contraction.parallel": False}) as session:
        assert choose("contraction.nr", 8, (4, 16)) == 8  # 5 is no alternative the rule offered
        assert choose("contraction.parallel", True, (True, False)) is False
    assert session.used == {"contraction.parallel"}
    assert session.offered == {"contraction.nr": (8, (4, 16)), "contraction.parallel": (True, (False,))}


def test_knob_candidates_are_distinct_schedules_that_compute_what_the_default_does():
    target = tvm.target.Target(AVX2_2)
    func = pointwise_conv()
    candidates = knob_candidates(func, target, limit=32)
    assert candidates[0].overrides == {}
    turned = {name for c in candidates[1:] for name in c.overrides}
    # The rule's own choices are the space: whole-vector padding of the 196 columns among them.
    assert {"contraction.pad_lanes", "contraction.mr", "contraction.parallel"} <= turned, turned
    digests = {tvm_ffi.structural_hash(c.schedule.mod) for c in candidates}
    assert len(digests) == len(candidates)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 116, 196), dtype=np.float32)
    w = rng.standard_normal((116, 116), dtype=np.float32)
    expected = np.einsum("nct,oc->not", x, w)
    for candidate in candidates:
        out = run(candidate.schedule.mod["main"], target, [x, w, np.zeros_like(expected)])
        np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4, err_msg=str(candidate.overrides))


@pytest.mark.slow
def test_a_candidate_measured_lucky_is_refused_when_re_timed_slower_than_the_default(tmp_path):
    """A candidate's record says it is fast (the luckiest of noisy timings), but it is really twice as slow
    (one register row instead of the rule's tile): re-timed side by side with the default, it is refused,
    and the shared database keeps the default."""
    target = tvm.target.Target(AVX2_2 | {"mcpu": tvm.target.codegen.llvm_get_system_cpu()})
    func = pointwise_conv()
    mod = tvm.IRModule({"main": func})
    default, _, _ = schedule_with(func, target, {})
    slower, used, _ = schedule_with(func, target, {"contraction.mr": 1})
    assert used == {"contraction.mr"}
    run_ = TuningRun(target.export(), str(tmp_path / "tuning"), str(tmp_path), None, None)
    args = ms.arg_info.ArgInfo.from_prim_func(func)
    shared = ms.database.MemoryDatabase()
    workload = shared.commit_workload(mod)
    shared.commit_tuning_record(ms.database.TuningRecord(default.trace, workload, [1e-3], target, args))
    merge_into_shared(str(tmp_path / "tuning"), shared)
    lucky = ms.database.MemoryDatabase()
    lucky.commit_tuning_record(ms.database.TuningRecord(slower.trace, lucky.commit_workload(mod), [1e-9], target, args))
    incumbent = records_of(open_shared_database(str(tmp_path / "tuning")), mod, target)[0]
    confirmed = ms.database.MemoryDatabase()
    assert run_._confirm_faster(mod, lucky, incumbent, confirmed) is None
    assert not confirmed.get_all_tuning_records()


def shipped_database(tmp_path, target_dict: dict):
    """A shared database whose one workload tuning improved (two records), written as the shipped file."""
    target = tvm.target.Target(target_dict)
    func = pointwise_conv(16, 32)
    mod = tvm.IRModule({"main": func})
    database = ms.database.MemoryDatabase()
    workload = database.commit_workload(mod)
    args = ms.arg_info.ArgInfo.from_prim_func(func)
    for overrides, seconds in (({}, 2e-6), ({"contraction.mr": 1}, 1e-6)):
        sch, _, _ = schedule_with(func, target, overrides)
        database.commit_tuning_record(ms.database.TuningRecord(sch.trace, workload, [seconds], target, args))
    merge_into_shared(str(tmp_path / "tuning"), database)
    shipped = tmp_path / "shipped"
    path = shipped_path(shipped, isa_key(target))
    assert write_shipped(str(tmp_path / "tuning"), target, path, {"cpu": "test"}, keep=set()) == 0  # none kept
    assert write_shipped(str(tmp_path / "tuning"), target, path, {"cpu": "test"}) == 1
    return mod, shipped


def test_a_shipped_record_is_used_only_on_the_isa_and_core_count_it_was_tuned_for(tmp_path):
    mod, shipped = shipped_database(tmp_path, AVX2_2)
    assert [p.name for p in shipped.iterdir()] == ["x86_64-avx2-2c.json.gz"]

    def records(target_dict: dict) -> list:
        target = tvm.target.Target(target_dict)
        return records_of(open_shared_database(None, target, shipped_dir=shipped), mod, target)

    assert len(records(AVX2_2)) == 1
    assert len(records(AVX2_2 | {"mcpu": "znver3"})) == 1  # another AVX2 CPU: the same ISA, retargeted
    assert records(AVX2_2 | {"mcpu": "skylake-avx512"}) == []
    assert records(AVX2_2 | {"num-cores": 4}) == []
    assert records(AVX2_2 | {"mcpu": "x86-64"}) == []  # no AVX2: no key at all
    # A file renamed to another ISA's name is not trusted.
    (shipped / "x86_64-avx2-2c.json.gz").rename(shipped / "x86_64-avx512-2c.json.gz")
    assert records(AVX2_2 | {"mcpu": "skylake-avx512"}) == []
    body = json.loads(gzip.decompress((shipped / "x86_64-avx512-2c.json.gz").read_bytes()))
    assert body["isa"] == "x86_64-avx2-2c" and body["provenance"] == {"cpu": "test"}


def test_a_shipped_record_schedules_the_kernel_at_its_first_compile(tmp_path):
    """The kernel is scheduled by the shipped record (the tuned trace), not by the rules."""
    from tvm import relax

    mod, shipped = shipped_database(tmp_path, AVX2_2)
    target = tvm.target.Target(AVX2_2)
    database = open_shared_database(None, target, shipped_dir=shipped)
    with target, database:
        applied = relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(mod)
    tuned, _, _ = schedule_with(mod["main"], target, {"contraction.mr": 1})
    assert applied["main"].attrs["tirx.is_scheduled"]
    assert tvm_ffi.structural_equal(applied["main"].body, tuned.mod["main"].body)
    rules_default, _, _ = schedule_with(mod["main"], target, {})
    assert not tvm_ffi.structural_equal(applied["main"].body, rules_default.mod["main"].body)
