"""compiler.storage.store: artifact keys and the atomic, content-addressed store.

``kernel.so`` is a dummy file here: the store never loads it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from compiler.storage.store import (
    LIBRARY_NAME,
    MANIFEST_NAME,
    KernelStore,
    LeaseTimeoutError,
    Manifest,
    artifact_key,
    host_name,
    process_token,
    tvm_version,
)

DIGEST = "ab" * 32
BUCKET = {"a": (4, 8), "b": (4, 8)}
TARGET = {"kind": "llvm", "mcpu": "znver3", "num-cores": 8}
OPTIONS = {"simplify": True, "pipeline": "default"}
KEY_ARGS = (DIGEST, BUCKET, TARGET, "0.27.0", OPTIONS)


def _manifest(key: str, **overrides) -> Manifest:
    fields = {
        "key": key,
        "graph_digest": DIGEST,
        "bucket": {name: list(shape) for name, shape in BUCKET.items()},
        "target": TARGET,
        "tvm_version": "0.27.0",
        "options": OPTIONS,
        "compile_seconds": 1.5,
        "simplified": True,
        "verified": True,
        "verification": "ok",
        "max_abs_error": 1e-6,
        "rtol": 1e-3,
        "atol": 1e-4,
        "library_bytes": 5,
        "created_at": time.time(),
    }
    return Manifest(**(fields | overrides))


def _dead_pid() -> int:
    """The pid of a child that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


def _commit(store: KernelStore, key: str, payload: bytes = b"dummy", **overrides) -> Manifest:
    with store.staging(key) as staging:
        (staging / LIBRARY_NAME).write_bytes(payload)
        return store.commit(staging, _manifest(key, library_bytes=len(payload), **overrides))


# --- artifact_key -----------------------------------------------------------


def test_key_is_a_sha256_hex_digest():
    key = artifact_key(*KEY_ARGS)
    assert len(key) == 64
    int(key, 16)
    assert artifact_key(*KEY_ARGS) == key


@pytest.mark.parametrize(
    ("position", "changed"),
    [
        (0, "cd" * 32),
        (1, {"a": (8, 8), "b": (8, 8)}),
        (1, {"a": (4, 8)}),
        (1, {"a": (4, 8), "c": (4, 8)}),
        (2, {"kind": "llvm", "mcpu": "skylake", "num-cores": 8}),
        (2, {"kind": "llvm", "mcpu": "znver3", "num-cores": 4}),
        (2, {"kind": "cuda", "arch": "sm_90"}),
        (3, "0.28.0"),
        (4, {"simplify": False, "pipeline": "default"}),
        (4, {"simplify": True, "pipeline": "other"}),
    ],
)
def test_key_changes_with_each_part(position, changed):
    args = list(KEY_ARGS)
    args[position] = changed
    assert artifact_key(*args) != artifact_key(*KEY_ARGS)


def test_key_is_stable_under_dict_ordering():
    reordered = (
        DIGEST,
        {"b": [4, 8], "a": [4, 8]},
        {"num-cores": 8, "mcpu": "znver3", "kind": "llvm"},
        "0.27.0",
        {"pipeline": "default", "simplify": True},
    )
    assert artifact_key(*reordered) == artifact_key(*KEY_ARGS)


def test_key_is_stable_under_nested_dict_ordering():
    host_one = {"kind": "llvm", "mcpu": "znver3"}
    host_two = {"mcpu": "znver3", "kind": "llvm"}
    one = artifact_key(DIGEST, BUCKET, {"kind": "cuda", "host": host_one}, "0.27.0", OPTIONS)
    two = artifact_key(DIGEST, BUCKET, {"host": host_two, "kind": "cuda"}, "0.27.0", OPTIONS)
    assert one == two


def test_tvm_version_is_the_installed_distribution():
    assert tvm_version()


# --- KernelStore ----------------------------------------------------------


def test_new_store_is_empty(tmp_path):
    store = KernelStore(tmp_path / "store")
    assert list(store.keys()) == []
    assert store.get(artifact_key(*KEY_ARGS)) is None
    assert (tmp_path / "store" / "artifacts").is_dir()
    assert (tmp_path / "store" / "staging").is_dir()


def test_commit_is_atomic_and_get_returns_the_manifest(tmp_path):
    store = KernelStore(tmp_path)
    key = artifact_key(*KEY_ARGS)
    with store.staging(key) as staging:
        assert staging.parent == store.staging_root
        assert staging.name.split(".")[1] == process_token(os.getpid())
        (staging / LIBRARY_NAME).write_bytes(b"dummy")
        assert store.get(key) is None
        committed = store.commit(staging, _manifest(key))
        assert not staging.exists()
    assert list(store.staging_root.iterdir()) == []
    assert store.get(key) == committed
    assert store.path(key) == tmp_path / "artifacts" / key[:2] / key
    assert store.library_path(key).read_bytes() == b"dummy"
    assert (store.path(key) / MANIFEST_NAME).is_file()
    assert list(store.keys()) == [key]


def test_manifest_survives_reopening(tmp_path):
    key = artifact_key(*KEY_ARGS)
    committed = _commit(KernelStore(tmp_path), key)
    assert KernelStore(tmp_path).get(key) == committed


def test_staging_is_removed_when_not_committed(tmp_path):
    store = KernelStore(tmp_path)
    key = artifact_key(*KEY_ARGS)
    with pytest.raises(RuntimeError), store.staging(key) as staging:
        (staging / LIBRARY_NAME).write_bytes(b"half")
        raise RuntimeError("build failed")
    assert list(store.staging_root.iterdir()) == []
    assert store.get(key) is None


def test_commit_without_library_fails(tmp_path):
    store = KernelStore(tmp_path)
    key = artifact_key(*KEY_ARGS)
    with store.staging(key) as staging, pytest.raises(FileNotFoundError):
        store.commit(staging, _manifest(key))
    assert store.get(key) is None


def test_directory_without_library_is_not_returned(tmp_path):
    store = KernelStore(tmp_path)
    key = artifact_key(*KEY_ARGS)
    directory = store.path(key)
    directory.mkdir(parents=True)
    (directory / MANIFEST_NAME).write_text(_manifest(key).model_dump_json())
    assert store.get(key) is None


def test_directory_with_a_broken_manifest_is_not_returned(tmp_path):
    store = KernelStore(tmp_path)
    key = artifact_key(*KEY_ARGS)
    directory = store.path(key)
    directory.mkdir(parents=True)
    (directory / LIBRARY_NAME).write_bytes(b"dummy")
    (directory / MANIFEST_NAME).write_text('{"key": "trunc')
    assert store.get(key) is None


def test_open_sweeps_staging_of_dead_processes_only(tmp_path):
    KernelStore(tmp_path)
    staging_root = tmp_path / "staging"
    dead = staging_root / f"{'0' * 16}.{_dead_pid()}-1.deadbeef"
    live = staging_root / f"{'1' * 16}.{process_token(os.getpid())}.cafebabe"
    # a process before a restart that had this very pid (in a container the server is pid 1 every time)
    same_pid_earlier = staging_root / f"{'2' * 16}.{os.getpid()}-1.cafebabe"
    deleted_by_dead = staging_root / f"deleted.{_dead_pid()}-5.00000000"
    unparseable = staging_root / "leftover"
    for directory in (dead, live, same_pid_earlier, deleted_by_dead, unparseable):
        directory.mkdir()
        (directory / LIBRARY_NAME).write_bytes(b"partial")

    KernelStore(tmp_path)
    assert sorted(p.name for p in staging_root.iterdir()) == [live.name]
    assert (live / LIBRARY_NAME).read_bytes() == b"partial"


def test_open_keeps_a_staging_dir_in_use_by_this_process(tmp_path):
    store = KernelStore(tmp_path)
    key = artifact_key(*KEY_ARGS)
    with store.staging(key) as staging:
        (staging / LIBRARY_NAME).write_bytes(b"dummy")
        KernelStore(tmp_path)  # another worker opening the same store
        assert staging.is_dir()
        store.commit(staging, _manifest(key))
    assert store.get(key) is not None


def test_second_commit_of_the_same_key_keeps_the_first(tmp_path):
    store = KernelStore(tmp_path)
    key = artifact_key(*KEY_ARGS)
    first = _commit(store, key, b"first", compile_seconds=1.0)
    second = _commit(store, key, b"second!", compile_seconds=2.0)
    assert second == first
    assert store.get(key) == first
    assert store.library_path(key).read_bytes() == b"first"
    assert list(store.staging_root.iterdir()) == []
    assert list(store.keys()) == [key]


def test_delete(tmp_path):
    store = KernelStore(tmp_path)
    key = artifact_key(*KEY_ARGS)
    other = artifact_key("cd" * 32, BUCKET, TARGET, "0.27.0", OPTIONS)
    _commit(store, key)
    _commit(store, other)
    assert sorted(store.keys()) == sorted([key, other])

    assert store.delete(key) is True
    assert store.get(key) is None
    assert not store.path(key).exists()
    assert list(store.staging_root.iterdir()) == []
    assert list(store.keys()) == [other]
    assert store.delete(key) is False

    # The key can be built again after a delete.
    assert _commit(store, key, b"again").key == key
    assert store.library_path(key).read_bytes() == b"again"


# --- the check at start -----------------------------------------------------


def test_check_removes_damaged_artifacts_and_keeps_sound_ones(tmp_path):
    store = KernelStore(tmp_path)
    keys = [artifact_key(DIGEST, {"a": (n, 8)}, TARGET, "0.27.0", OPTIONS) for n in range(1, 7)]
    for key in keys:
        _commit(store, key)
    sound, no_library, truncated, garbage, wrong_key, no_manifest = keys
    (store.library_path(no_library)).unlink()
    (store.library_path(truncated)).write_bytes(b"du")
    (store.path(garbage) / MANIFEST_NAME).write_text("{not json")
    (store.path(wrong_key) / MANIFEST_NAME).write_text(_manifest(sound, library_bytes=5).model_dump_json())
    (store.path(no_manifest) / MANIFEST_NAME).unlink()
    ok, removed = store.check()
    assert ok == 1
    assert sorted(removed) == sorted(
        [
            f"{no_library}: no kernel library",
            f"{truncated}: kernel library is 2 bytes, the manifest says 5",
            f"{garbage}: unreadable manifest",
            f"{wrong_key}: manifest names key {sound[:16]}",
            f"{no_manifest}: no manifest",
        ]
    )
    assert [key for key in keys if store.path(key).exists()] == [sound]
    assert store.get(sound) is not None
    assert list(store.staging_root.iterdir()) == []
    assert store.check() == (1, [])


# --- several processes on one store ------------------------------------------


def test_open_keeps_another_hosts_staging_until_it_is_a_day_old(tmp_path):
    """Replicas on a shared volume run on other hosts: their pids mean nothing here."""
    KernelStore(tmp_path)
    staging_root = tmp_path / "staging"
    other_host = "replica-b" if host_name() != "replica-b" else "replica-c"
    fresh = staging_root / f"{'0' * 16}.{other_host}+1-100.deadbeef"
    stale = staging_root / f"{'1' * 16}.{other_host}+1-100.cafebabe"
    here_dead = staging_root / f"{'2' * 16}.{host_name()}+{_dead_pid()}-1.cafebabe"
    for directory in (fresh, stale, here_dead):
        directory.mkdir()
    two_days_ago = time.time() - 2 * 24 * 3600
    os.utime(stale, (two_days_ago, two_days_ago))

    KernelStore(tmp_path)
    assert sorted(p.name for p in staging_root.iterdir()) == [fresh.name]


HOLD_LEASE = """
import sys, time
from compiler.storage.store import KernelStore
store = KernelStore(sys.argv[1])
with store.lease(sys.argv[2], max_wait=60) as lease:
    print("held" if lease.held else "not held", flush=True)
    if sys.argv[3] == "commit":
        from tests.compiler.test_store import _commit
        time.sleep(0.5)
        _commit(store, sys.argv[2])
    else:
        time.sleep(600)
"""


def _hold_lease(tmp_path, key: str, then: str) -> subprocess.Popen:
    """Another process on the store, holding the build lease of ``key`` (sleeping, or committing it)."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LEASE, str(tmp_path), key, then], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_lease_is_held_by_one_process_and_taken_over_when_its_holder_is_killed(tmp_path):
    store = KernelStore(tmp_path)
    key = artifact_key(*KEY_ARGS)
    holder = _hold_lease(tmp_path, key, "sleep")
    try:
        with pytest.raises(LeaseTimeoutError, match=f'"pid": {holder.pid}'), store.lease(key, max_wait=0.5):
            pass
        killer = threading.Timer(1.0, holder.kill)
        killer.start()
        started = time.monotonic()
        with store.lease(key, max_wait=30) as lease:
            waited = time.monotonic() - started
            assert lease.held
            assert f'"pid": {holder.pid}' in lease.holder  # who held it before: the killed process
        assert 0.9 < waited < 3.0  # taken over at once, not after some expiry
    finally:
        holder.kill()
        holder.wait()


def test_a_waiter_finds_the_kernel_its_lease_holder_committed(tmp_path):
    store = KernelStore(tmp_path)
    key = artifact_key(*KEY_ARGS)
    holder = _hold_lease(tmp_path, key, "commit")
    try:
        with store.lease(key, max_wait=30) as lease:
            assert store.get(key) is not None  # built by the holder: nothing left to build
            assert lease.holder is not None
        assert holder.wait(30) == 0
    finally:
        holder.kill()
    assert not (store.leases / f"{key}.lock").exists()  # gone once its kernel is there
