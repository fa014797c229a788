"""MetaSchedule tuning of a tiny kernel, and the shared database across processes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from compiler.building.build import compile_bucket, profile_kernel
from compiler.building.options import CompileOptions
from compiler.building.target import resolve_target
from compiler.errors import CompileError
from compiler.measuring.tuning_plan import kernel_times
from compiler.models.demo import demo_model_bytes
from compiler.models.model import load_model
from compiler.storage.store import KernelStore
from compiler.tvm.tensor_intrinsics import intrinsic_families
from tests.rpcfleet import RpcFleet

pytestmark = pytest.mark.slow

# In a fresh process: load the shared database and check that its records
# schedule the fused kernels of the same bucket (MetaScheduleApplyDatabase).
APPLY_IN_FRESH_PROCESS = textwrap.dedent(
    """
    import json, sys
    import onnx, tvm
    from tvm import relax
    from compiler.models.demo import demo_model_bytes
    from compiler.tvm.pipeline import tuned_module_passes
    from compiler.tvm.tuning_database import open_shared_database
    from compiler.tvm.build import import_relax, specialize

    database_dir, target = sys.argv[1], json.loads(sys.argv[2])
    database = open_shared_database(database_dir)
    bucket = {"x": (8, 4)}
    model, _ = specialize(onnx.load_from_string(demo_model_bytes()), bucket, True)
    mod = import_relax(model, bucket, {"x": "float32"})
    target = tvm.target.Target(target)
    with target, database:
        mod = tvm.transform.Sequential(
            tuned_module_passes(target) + [relax.transform.MetaScheduleApplyDatabase(enable_warning=False)]
        )(mod)
    scheduled = [
        gv.name_hint for gv, f in mod.functions_items()
        if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None and f.attrs.get("tirx.is_scheduled", 0) == 1
    ]
    print(json.dumps({"records": len(database.get_all_tuning_records()), "scheduled": scheduled}))
    """
)


def test_tuning_round_trip_through_the_shared_database(tmp_path):
    store = KernelStore(tmp_path / "kernels")
    database_dir = tmp_path / "tuning"
    model = load_model(demo_model_bytes(), max_bytes=1 << 20)
    target = resolve_target("llvm")
    tuned = CompileOptions(tune_trials=4, tune_trials_per_task=2, database_dir=str(database_dir))
    plain = compile_bucket(model, {"x": (8, 4)}, target, store, CompileOptions(database_dir=str(database_dir)))
    ranking = kernel_times(profile_kernel(model, plain.manifest, store, {"x": [8, 4]}, CompileOptions()))

    outcome = compile_bucket(model, {"x": (8, 4)}, target, store, tuned, kernel_times=ranking)
    assert outcome.manifest.verified is True, outcome.manifest.verification
    tuning = outcome.manifest.tuning
    assert tuning["trials"] >= 1
    assert tuning["tasks"] >= 2
    # Every task's default schedule was timed and recorded next to the trials.
    assert tuning["default_schedules"] == tuning["tasks"]
    assert plain.manifest.key != outcome.manifest.key  # tuned kernels are their own tier
    # Its tasks are the profiled kernels, by name, ranked by what they lose to ONNX Runtime.
    plan = tuning["plan"]
    assert {row["kernel"] for row in plan} <= set(ranking)
    assert any(row["ratio_vs_ort"] for row in plan), (plan, ranking)
    assert [row["priority"] for row in plan] == sorted((row["priority"] for row in plan), reverse=True)
    assert sum(row["trials"] for row in plan) == tuning["trials"]

    def fresh_process() -> dict:
        run = subprocess.run(
            [sys.executable, "-c", APPLY_IN_FRESH_PROCESS, str(database_dir), json.dumps(target)],
            capture_output=True,
            text=True,
            check=True,
        )
        return json.loads(run.stdout.strip().splitlines()[-1])

    first = fresh_process()
    assert first["records"] >= 1
    assert len(first["scheduled"]) == outcome.manifest.tuning["tasks"], "a fused kernel took no tuning record"

    # Tuning another bucket merges into the same database and keeps the earlier records.
    compile_bucket(model, {"x": (16, 4)}, target, store, tuned)
    second = fresh_process()
    assert second["records"] > first["records"]
    assert set(first["scheduled"]) <= set(second["scheduled"])
    assert not list(database_dir.glob(".merge-*"))

    # The same workloads under another budget (another kernel key): none is timed or tuned twice.
    again = compile_bucket(model, {"x": (8, 4)}, target, store, tuned.model_copy(update={"tune_trials": 6}))
    assert again.manifest.verified is True
    assert again.manifest.tuning["default_schedules"] == 0
    tuned_before = {row["kernel"] for row in plan if row["trials"]}
    skipped = {row["kernel"]: row for row in again.manifest.tuning["plan"] if row["kernel"] in tuned_before}
    assert {row["reason"] for row in skipped.values()} == {"tuned before (shared database)"}
    assert {row["trials"] for row in skipped.values()} == {0}


def test_tuning_over_rpc_measures_on_the_fleet_and_every_replica_compiles_the_same_kernel_from_its_records(
    tmp_path,
):
    """A tuning box's RPC servers measure the candidates; the records land in the shared database, and a
    replica compiling from them (no tuning of its own) gets the very kernel the tuning compile built."""
    database_dir = tmp_path / "tuning"
    model = load_model(demo_model_bytes(), max_bytes=1 << 20)
    target = resolve_target("llvm")
    fleet = RpcFleet(tmp_path, servers=2).start()
    try:
        rpc = {"rpc_tracker": fleet.tracker, "rpc_key": fleet.key}
        tuned = CompileOptions(tune_trials=8, tune_trials_per_task=4, database_dir=str(database_dir), **rpc)
        outcome = compile_bucket(model, {"x": (8, 4)}, target, KernelStore(tmp_path / "replica-a"), tuned)
        measured = fleet.measurements()
        with pytest.raises(CompileError, match="no server registered under key 'elsewhere'"):
            nowhere = tuned.model_copy(update={"rpc_key": "elsewhere"})
            compile_bucket(model, {"x": (16, 4)}, target, KernelStore(tmp_path / "replica-a"), nowhere)
    finally:
        fleet.stop()
    manifest = outcome.manifest
    assert manifest.verified is True, manifest.verification
    assert manifest.tuning["measured_on"] == f"rpc {fleet.tracker} {fleet.key} x2"
    assert manifest.tuning["trials"] >= 1
    print(f"\ncandidates measured per RPC server: {measured}")
    assert min(measured) >= 1  # both servers measured candidates
    tuning = manifest.tuning
    assert sum(measured) == tuning["trials"] + tuning["default_schedules"] + tuning["confirmations"]

    replica = compile_bucket(
        model,
        {"x": (8, 4)},
        target,
        KernelStore(tmp_path / "replica-b"),
        CompileOptions(database_dir=str(database_dir)),
    )
    assert replica.manifest.verified is True
    assert replica.manifest.schedule_digest == manifest.schedule_digest


# In a fresh process: register an AVX-512 VNNI target's intrinsics only, then let MetaSchedule generate
# the design space of a u8 x s8 matmul, which tensorizes with an x86 intrinsic.
VNNI_SPACE_IN_FRESH_PROCESS = textwrap.dedent(
    """
    import json, sys, time
    started = time.perf_counter()
    from compiler.tvm.tensor_intrinsics import register_tensor_intrinsics
    import tvm
    from tvm import te
    from tvm.s_tir import meta_schedule as ms

    target = {"kind": "llvm", "mcpu": "cascadelake", "num-cores": 2}
    register_tensor_intrinsics(target)
    a = te.placeholder((64, 128), "uint8", "a")
    b = te.placeholder((128, 128), "int8", "b")
    k = te.reduce_axis((0, 128), "k")
    c = te.compute((64, 128), lambda i, j: te.sum(a[i, k].astype("int32") * b[j, k].astype("int32"), axis=k))
    context = ms.TuneContext(
        mod=tvm.IRModule({"main": te.create_prim_func([a, b, c])}),
        target=tvm.target.Target(target),
        space_generator="post-order-apply",
        search_strategy="evolutionary",
    )
    spaces = context.generate_design_space()

    def families():
        return sorted(n.rsplit(".", 1)[1] for n in sys.modules if n.startswith("tvm.s_tir.tensor_intrin."))

    seconds, x86_only = time.perf_counter() - started, families()
    # A later tuning run in the same process, for another family, still gets that family's intrinsics.
    register_tensor_intrinsics({"kind": "llvm", "mtriple": "aarch64-linux-gnu"})
    print(json.dumps({
        "tensorized": sum("tensorize" in str(space.trace) for space in spaces),
        "families": x86_only,
        "then": families(),
        "seconds": seconds,
    }))
    """
)


def test_tuning_registers_only_its_targets_tensor_intrinsics_and_rules_still_find_them():
    """TVM's intrinsics package parses every vendor's TVMScript (40 s a tuning run); the x86 family alone
    is enough for an x86 target, and its VNNI rule still tensorizes an int8 matmul."""
    run = subprocess.run(
        [sys.executable, "-c", VNNI_SPACE_IN_FRESH_PROCESS], check=False, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["tensorized"] >= 1
    assert result["families"] == ["x86"]
    assert "arm_cpu" in result["then"] and "x86" in result["then"] and "cuda" not in result["then"]
    print(f"\nintrinsics registered and design space generated in {result['seconds']:.1f} s")


def test_each_target_family_names_its_intrinsics_module():
    assert intrinsic_families({"kind": "llvm", "mcpu": "znver3"}) == ("x86",)
    assert intrinsic_families({"kind": "llvm", "mtriple": "aarch64-linux-gnu"}) == ("arm_cpu",)
    assert intrinsic_families({"kind": "cuda", "arch": "sm_90"}) == ("cuda", "dot_product_common")
    assert intrinsic_families({"kind": "rocm"}) is None  # unknown families import the whole package


def test_intrinsics_are_parsed_with_the_stack_inspect_would_give():
    """TVMScript reads each frame's locals and context line from ``inspect.stack()``; the quick stack the
    intrinsics are imported under gives the same frames, names, lines and context."""
    import inspect

    from compiler.tvm.tensor_intrinsics import _frames_without_source_lookup

    def caller():
        return inspect.stack()

    original, slow = inspect.stack, caller()
    with _frames_without_source_lookup():
        quick = caller()
    assert len(quick) == len(slow)
    for at, (fast, full) in enumerate(zip(quick, slow, strict=True)):
        assert (fast.filename, fast.function, fast.frame.f_code) == (full.filename, full.function, full.frame.f_code)
        if at != 1:  # frame 1 is this test, on the two lines that call caller()
            assert (fast.lineno, fast.code_context) == (full.lineno, full.code_context)
    assert quick[1].code_context == ["        quick = caller()\n"]
    assert inspect.stack is original  # put back after the import
