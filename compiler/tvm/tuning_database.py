"""The shared MetaSchedule tuning database, in the data dir: every bucket, model and restart reads it.

A tuning run writes into its own database first and then merges into the
shared one under a file lock, replacing each file in one rename, so a
compile reading it never sees a half-written file. Records are keyed by
workload (the kernel's TIR, structurally): a task any bucket or model
tuned is found tuned by every other that shares it.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import tvm_ffi
from tvm.s_tir import meta_schedule as ms

WORKLOADS = "database_workload.json"
RECORDS = "database_tuning_record.json"
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


def open_shared_database(directory: str | None):
    """The shared database loaded in memory, or None when there is none yet."""
    if directory is None:
        return None
    path = Path(directory)
    with _locked(path, exclusive=False):
        if not (path / WORKLOADS).is_file() or not (path / RECORDS).is_file():
            return None
        on_disk = ms.database.JSONDatabase(
            path_workload=str(path / WORKLOADS), path_tuning_record=str(path / RECORDS), allow_missing=False
        )
        # A memory copy: later merges by other processes cannot change it under us.
        memory = ms.database.MemoryDatabase()
        _copy_records(on_disk, memory)
        return memory


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
