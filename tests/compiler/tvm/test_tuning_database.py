"""The shared tuning database under concurrent writers: replicas (and their
tuning children) merge records into one database on the shared volume, and
none is lost."""

from __future__ import annotations

import multiprocessing

from compiler.tvm.tuning_database import open_shared_database

WRITERS, ROUNDS = 4, 8


def merge_records(database_dir: str, writer: int) -> None:
    """``ROUNDS`` merges of one record each, for matmuls no other writer has (a distinct workload)."""
    import tvm
    from tvm import te
    from tvm.s_tir import meta_schedule as ms

    from compiler.tvm.tuning_database import merge_into_shared

    def matmul(n: int):
        a, b = te.placeholder((n, n), name="A"), te.placeholder((n, n), name="B")
        k = te.reduce_axis((0, n), name="k")
        c = te.compute((n, n), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="C")
        return te.create_prim_func([a, b, c])

    target = tvm.target.Target({"kind": "llvm"})
    for round_ in range(ROUNDS):
        n = 8 + writer * ROUNDS + round_
        func = matmul(n)
        mod = tvm.IRModule({"main": func})
        run = ms.database.MemoryDatabase()
        workload = run.commit_workload(mod)
        trace = tvm.s_tir.Schedule(mod).trace
        args = ms.arg_info.ArgInfo.from_prim_func(func)
        run.commit_tuning_record(ms.database.TuningRecord(trace, workload, [n * 1e-6], target, args))  # n names it
        merge_into_shared(database_dir, run)


def test_concurrent_writers_lose_no_tuning_record(tmp_path):
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=merge_records, args=(str(tmp_path), w)) for w in range(WRITERS)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(120)
    assert [writer.exitcode for writer in writers] == [0] * WRITERS

    records = open_shared_database(str(tmp_path)).get_all_tuning_records()
    sizes = sorted(round(float(record.run_secs[0]) * 1e6) for record in records)  # each writer's n
    assert sizes == list(range(8, 8 + WRITERS * ROUNDS))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".merge-")]
