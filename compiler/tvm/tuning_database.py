"""The shared MetaSchedule tuning database, in the data dir: every bucket, model and restart reads it;
and the database shipped with the compiler (``compiler/tuning_db``), tuned on the project's machines.

A tuning run writes into its own database first and then merges into the
shared one under a file lock, replacing each file in one rename, so a
compile reading it never sees a half-written file. Records are keyed by
workload (the kernel's TIR, structurally): a task any bucket or model
tuned is found tuned by every other that shares it.

The shipped database holds one file per vector ISA and core count (:func:`isa_key`): a schedule tuned
for AVX-512 on 2 cores is wrong-sized for AVX2 or for 16 cores, so a record is used only where both
match. Its records join the shared ones in memory, retargeted to the compile's own target (the CPU
model may differ within an ISA); tuning here re-times them as any incumbent, and replaces those it beats.
"""

from __future__ import annotations

import fcntl
import gzip
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import tvm_ffi
from tvm.s_tir import meta_schedule as ms

from . import SHIPPED_TUNING_DIR

WORKLOADS = "database_workload.json"
RECORDS = "database_tuning_record.json"
SHIPPED_DIR = SHIPPED_TUNING_DIR
TRIALS = "trials.json"
"""Trials spent on each workload (by structural hash), whatever came of them: a workload tuned before is
not tuned again, while the database keeps only the candidates confirmed faster."""


@contextmanager
def _locked(directory: Path, exclusive: bool):
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def open_shared_database(directory: str | None, target=None, shipped_dir: Path | None = SHIPPED_DIR):
    """The shared database loaded in memory, with the shipped records for ``target``'s ISA and cores
    (where given); None when there are none."""
    memory = ms.database.MemoryDatabase()
    count = _copy_shipped(shipped_dir, target, memory) if target is not None and shipped_dir else 0
    if directory is None:
        return memory if count else None
    path = Path(directory)
    with _locked(path, exclusive=False):
        if not (path / WORKLOADS).is_file() or not (path / RECORDS).is_file():
            return memory if count else None
        on_disk = ms.database.JSONDatabase(
            path_workload=str(path / WORKLOADS), path_tuning_record=str(path / RECORDS), allow_missing=False
        )
        # A memory copy: later merges by other processes cannot change it under us.
        _copy_records(on_disk, memory)
        return memory


def isa_key(target) -> str | None:
    """``x86_64-avx512-2c``: the vector ISA and core count a CPU record is tuned for; None for targets the
    shipped database has no records for (GPUs, other CPUs)."""
    if target.kind.name != "llvm" or not str(target.attrs.get("mtriple", "") or "x86_64").startswith("x86_64"):
        return None
    from tvm.target.codegen import llvm_cpu_has_features

    if llvm_cpu_has_features("avx512f", target):
        isa = "avx512"
    elif llvm_cpu_has_features("avx2", target) and llvm_cpu_has_features("fma", target):
        isa = "avx2"
    else:
        return None
    return f"x86_64-{isa}-{int(target.attrs.get('num-cores', 0) or 0)}c"


def shipped_path(shipped_dir: Path, key: str) -> Path:
    return shipped_dir / f"{key}.json.gz"


def _copy_shipped(shipped_dir: Path, target, destination) -> int:
    """The shipped records for ``target``'s :func:`isa_key` committed into ``destination``, retargeted."""
    key = isa_key(target)
    path = shipped_path(shipped_dir, key) if key else None
    if path is None or not path.is_file():
        return 0
    # Parsed once per process and file: a tuning run opens the database again for every task it tunes.
    cache_key = (str(path), path.stat().st_mtime_ns, str(target))
    if cache_key not in _SHIPPED:
        _SHIPPED[cache_key] = _read_shipped(path, key, target)
    return _copy_records(_SHIPPED[cache_key], destination)


_SHIPPED: dict[tuple, object] = {}


def _read_shipped(path: Path, key: str, target):
    """A shipped file's records in memory, retargeted to ``target`` (none where the file is not ``key``'s)."""
    memory = ms.database.MemoryDatabase()
    shipped = json.loads(gzip.decompress(path.read_bytes()))
    if shipped.get("isa") != key:  # a file renamed by hand is not trusted
        return memory
    with tempfile.TemporaryDirectory(prefix="jitserve-shipped-") as staging:
        (Path(staging) / WORKLOADS).write_text(shipped["workloads"])
        (Path(staging) / RECORDS).write_text(shipped["records"])
        for record in _json_database(Path(staging)).get_all_tuning_records():
            workload = memory.commit_workload(record.workload.mod)
            memory.commit_tuning_record(
                ms.database.TuningRecord(record.trace, workload, record.run_secs, target, record.args_info)
            )
    return memory


def _json_database(directory: Path):
    return ms.database.JSONDatabase(
        path_workload=str(directory / WORKLOADS), path_tuning_record=str(directory / RECORDS), allow_missing=False
    )


def improved_workloads(directory: str) -> dict[int, str]:
    """Each workload of the shared database in ``directory`` that tuning improved (it holds more than the
    default schedule's record): its structural hash -> its fastest record's trace, as text."""
    path = Path(directory)
    if not (path / WORKLOADS).is_file():
        return {}
    with _locked(path, exclusive=False):
        database = _json_database(path)
        improved = {}
        for workload in _workloads(database):
            top = database.get_top_k(workload, 2)  # a JSON database reserves room for k: not 1 << 30
            if len(top) >= 2:
                improved[int(tvm_ffi.structural_hash(workload.mod))] = str(top[0].trace)
        return improved


def write_shipped(directory: str, target, path: Path, provenance: dict, keep: set[int] | None = None) -> int:
    """The fastest record of each workload of the shared database in ``directory`` that tuning improved
    (those in ``keep`` alone, by structural hash, where given), written to ``path`` for ``target``'s ISA;
    returns how many. The file is gzipped JSON: the ISA key, the provenance, and a JSON database's two
    files as text (MetaSchedule writes its traces; their Python form does not serialize every argument)."""
    with tempfile.TemporaryDirectory(prefix="jitserve-shipping-") as staging:
        chosen = ms.database.JSONDatabase(work_dir=staging)
        with _locked(Path(directory), exclusive=False):
            database = _json_database(Path(directory))
            count = 0
            for workload in _workloads(database):
                top = database.get_top_k(workload, 2)  # a JSON database reserves room for k: not 1 << 30
                if len(top) < 2 or str(top[0].target) != str(target):
                    continue
                if keep is not None and int(tvm_ffi.structural_hash(workload.mod)) not in keep:
                    continue
                record = top[0]
                chosen.commit_tuning_record(
                    ms.database.TuningRecord(
                        record.trace, chosen.commit_workload(workload.mod), record.run_secs, target, record.args_info
                    )
                )
                count += 1
        body = {
            "isa": isa_key(target),
            "provenance": provenance,
            "workloads": (Path(staging) / WORKLOADS).read_text() if count else "",
            "records": (Path(staging) / RECORDS).read_text() if count else "",
        }
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_suffix(".tmp")
    staged.write_bytes(gzip.compress(json.dumps(body, sort_keys=True).encode(), mtime=0))
    os.replace(staged, path)
    return count


def _workloads(database) -> list:
    """Every workload ``database`` holds records for, once each (by structural hash)."""
    seen: dict[int, object] = {}
    for record in database.get_all_tuning_records():
        seen.setdefault(int(tvm_ffi.structural_hash(record.workload.mod)), record.workload)
    return list(seen.values())


def _copy_records(source, destination) -> int:
    count = 0
    for record in source.get_all_tuning_records():
        workload = destination.commit_workload(record.workload.mod)
        destination.commit_tuning_record(
            ms.database.TuningRecord(record.trace, workload, record.run_secs, record.target, record.args_info)
        )
        count += 1
    return count


def workload_key(mod) -> str:
    return str(tvm_ffi.structural_hash(mod))


def read_trials(directory: str | None) -> dict[str, int]:
    """Trials spent so far on each workload (:func:`workload_key`)."""
    if directory is None:
        return {}
    path = Path(directory)
    with _locked(path, exclusive=False):
        return json.loads((path / TRIALS).read_text()) if (path / TRIALS).is_file() else {}


def merge_into_shared(directory: str, run_database, trials: dict[str, int] | None = None) -> int:
    """Copy ``run_database``'s records into the shared database, and add ``trials`` (workload key -> trials
    spent) to its ledger; each file is replaced in one rename."""
    path = Path(directory)
    with _locked(path, exclusive=True):
        if trials:
            ledger = json.loads((path / TRIALS).read_text()) if (path / TRIALS).is_file() else {}
            for key, count in trials.items():
                ledger[key] = ledger.get(key, 0) + count
            staged = path / f".{TRIALS}.{os.getpid()}.tmp"
            staged.write_text(json.dumps(ledger))
            os.replace(staged, path / TRIALS)
        staging = Path(tempfile.mkdtemp(prefix=".merge-", dir=path))
        try:
            merged = ms.database.JSONDatabase(work_dir=str(staging))
            if (path / WORKLOADS).is_file() and (path / RECORDS).is_file():
                _copy_records(
                    ms.database.JSONDatabase(
                        path_workload=str(path / WORKLOADS),
                        path_tuning_record=str(path / RECORDS),
                        allow_missing=False,
                    ),
                    merged,
                )
            added = _copy_records(run_database, merged)
            # Workloads first: records only ever point at workloads already there.
            os.replace(staging / WORKLOADS, path / WORKLOADS)
            os.replace(staging / RECORDS, path / RECORDS)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return added


def records_of(database, mod, target) -> list:
    """The measured records ``database`` holds for ``mod``'s workload on ``target``, fastest first (its
    default schedule's among them); none without a database."""
    if database is None or not database.has_workload(mod):
        return []
    records = database.get_top_k(database.commit_workload(mod), 1 << 30)
    return [record for record in records if str(record.target) == str(target)]
