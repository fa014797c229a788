"""compiler.storage.store_budget: which kernels and prepared weights a store over its budget removes, and in
which order. Entries are real store entries (committed kernels, prepared folders) whose library is a
dummy file: the budget never loads one."""

from __future__ import annotations

import os
import time

import numpy as np
from onnx import TensorProto, helper

from compiler.models.weights import save_prepared
from compiler.storage.store import KernelStore
from compiler.storage.store_budget import (
    LEAST_RECENTLY_USED,
    UNREFERENCED,
    enforce_budget,
    plan_removals,
    store_entries,
    touch,
)
from tests.compiler.test_store import _commit

HOUR = 3600.0
KILOBYTE = b"k" * 1024


def _kernel(store: KernelStore, name: str, *, age: float, size: int = 1024) -> str:
    key = name * 64 if len(name) == 1 else name
    _commit(store, key, b"k" * size)
    then = time.time() - age
    os.utime(store.path(key), (then, then))
    return key


def _weights(store: KernelStore, digest: str, *, age: float) -> None:
    graph = helper.make_model(
        helper.make_graph([], "g", [], [helper.make_tensor_value_info("w", TensorProto.FLOAT, [256])])
    )
    staging = store.staging_area.entry("prepared")
    save_prepared(staging, graph, {"w": np.ones(256, np.float32)})
    store.commit_prepared(staging, digest)
    then = time.time() - age
    os.utime(store.prepared_path(digest), (then, then))


def _plan(store: KernelStore, budget: int, **sets) -> list[tuple[str, str]]:
    arguments = {"referenced_kernels": set(), "referenced_weights": set(), "in_use": set()} | sets
    plan = plan_removals(store_entries(store), budget, grace_seconds=HOUR, now=time.time(), **arguments)
    return [(removal.entry.name, removal.reason) for removal in plan]


def test_within_budget_nothing_is_removed(tmp_path):
    store = KernelStore(tmp_path)
    _kernel(store, "a", age=10 * HOUR)
    assert _plan(store, 1 << 20) == []


def test_unreferenced_go_first_oldest_first_then_least_recently_used(tmp_path):
    store = KernelStore(tmp_path)
    old_deleted = _kernel(store, "a", age=5 * HOUR)
    new_deleted = _kernel(store, "b", age=2 * HOUR)
    served_old = _kernel(store, "c", age=9 * HOUR)
    served_new = _kernel(store, "d", age=3 * HOUR)
    sizes = {entry.name: entry.bytes for entry in store_entries(store)}
    referenced = {served_old, served_new}
    # Over by one kernel: the oldest unreferenced one, though a referenced one is older.
    plan = _plan(store, sum(sizes.values()) - 1, referenced_kernels=referenced)
    assert plan == [(old_deleted, UNREFERENCED)]
    # Over by three: both unreferenced, then the least recently used referenced one.
    plan = _plan(
        store, sum(sizes.values()) - sizes[old_deleted] - sizes[new_deleted] - 1, referenced_kernels=referenced
    )
    assert plan == [(old_deleted, UNREFERENCED), (new_deleted, UNREFERENCED), (served_old, LEAST_RECENTLY_USED)]


def test_never_in_use_nor_within_grace_nor_a_stored_versions_weights(tmp_path):
    store = KernelStore(tmp_path)
    in_use = _kernel(store, "a", age=9 * HOUR)
    _kernel(store, "b", age=60)  # a peer loaded it a minute ago
    _weights(store, "f" * 64, age=9 * HOUR)  # the weights of a stored version
    _weights(store, "e" * 64, age=9 * HOUR)  # a deleted version's
    plan = _plan(store, 0, referenced_kernels={in_use}, referenced_weights={"f" * 64}, in_use={in_use})
    assert plan == [("e" * 64, UNREFERENCED)]


def test_enforce_budget_removes_and_reports_what_is_left(tmp_path):
    store = KernelStore(tmp_path)
    kept = _kernel(store, "a", age=9 * HOUR)
    doomed = _kernel(store, "b", age=9 * HOUR)
    _weights(store, "e" * 64, age=9 * HOUR)
    total = sum(entry.bytes for entry in store_entries(store))
    removed, remaining = enforce_budget(
        store, 1, referenced_kernels=set(), referenced_weights=set(), in_use={kept}, grace_seconds=HOUR
    )
    assert {removal.entry.name for removal in removed} == {doomed, "e" * 64}
    assert store.get(doomed) is None and not store.has_prepared("e" * 64) and store.get(kept) is not None
    assert remaining == total - sum(removal.entry.bytes for removal in removed)
    assert remaining == sum(entry.bytes for entry in store_entries(store))
    assert not list(store.staging_root.iterdir())  # nothing half-removed left behind
    # What is in use was marked used now: it no longer looks idle to a peer's sweep.
    assert time.time() - store.path(kept).stat().st_mtime < 60


def test_touch_marks_a_kernel_used(tmp_path):
    store = KernelStore(tmp_path)
    key = _kernel(store, "a", age=9 * HOUR)
    touch(store, {key, "0" * 64})  # a key no longer stored is ignored
    assert _plan(store, 0) == []  # within the grace period now
