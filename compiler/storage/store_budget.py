"""The artifact store's byte budget: what to remove when it is over.

Two kinds of entry take room: kernels (code and manifest, one per key) and
prepared weights (one folder per model version). The store cannot tell by
itself which are still wanted, so the caller says:

- *referenced*: kernels and weights of a model version still stored (a
  current version's buckets; other replicas serve the same versions);
- *in use*: kernels loaded in this process's memory.

An entry's time of last use is its folder's mtime: a kernel is touched when a
process loads it, and every process touches what it holds at each sweep, so a
kernel a peer holds in memory always looks recently used (the sweep interval
is shorter than the grace period).

Removal order, until the store fits:

1. kernels and weights nothing references (a deleted model, a superseded
   version, a graph no longer served), unused for ``grace_seconds``: a replica
   still serving the old version finishes first;
2. referenced kernels, least recently used first, unused for
   ``grace_seconds`` and not in use here: needed again, they compile again
   (or come back from a peer).

Prepared weights of a stored version are never removed: every kernel of the
version needs them. A kernel in use is never removed.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

from .store import KernelStore

UNREFERENCED = "unreferenced"
LEAST_RECENTLY_USED = "least_recently_used"
REMOVAL_REASONS = (UNREFERENCED, LEAST_RECENTLY_USED)


@dataclass(frozen=True)
class StoreEntry:
    kind: str
    """``kernel`` (name: its key) or ``weights`` (name: the model version's digest)."""
    name: str
    path: Path
    bytes: int
    last_used: float


@dataclass(frozen=True)
class Removal:
    entry: StoreEntry
    reason: str


def _folder_bytes(path: Path) -> int:
    total = 0
    with contextlib.suppress(OSError):
        for child in path.iterdir():
            with contextlib.suppress(OSError):
                total += child.stat().st_size
    return total


def _entry(kind: str, path: Path) -> StoreEntry | None:
    try:
        last_used = path.stat().st_mtime
    except OSError:
        return None  # removed meanwhile
    return StoreEntry(kind, path.name, path, _folder_bytes(path), last_used)


def store_entries(store: KernelStore) -> list[StoreEntry]:
    """Every committed kernel and prepared-weights folder, with its size and time of last use."""
    entries = []
    for key in list(store.keys()):
        if (found := _entry("kernel", store.path(key))) is not None:
            entries.append(found)
    with contextlib.suppress(OSError):
        for folder in store.prepared.iterdir():
            if folder.is_dir() and (found := _entry("weights", folder)) is not None:
                entries.append(found)
    return entries


def touch(store: KernelStore, keys: set[str]) -> None:
    """Mark kernels as used now (their folder's mtime): what a process holds must not look idle."""
    for key in keys:
        with contextlib.suppress(OSError):
            os.utime(store.path(key))


def plan_removals(
    entries: list[StoreEntry],
    budget_bytes: int,
    *,
    referenced_kernels: set[str],
    referenced_weights: set[str],
    in_use: set[str],
    grace_seconds: float,
    now: float,
) -> list[Removal]:
    """What to remove, in order, so that the store fits ``budget_bytes`` (or as near as the rules allow)."""
    excess = sum(entry.bytes for entry in entries) - budget_bytes
    if excess <= 0:
        return []
    idle = [entry for entry in entries if now - entry.last_used >= grace_seconds and entry.name not in in_use]
    unreferenced = [
        entry
        for entry in idle
        if entry.name not in (referenced_kernels if entry.kind == "kernel" else referenced_weights)
    ]
    unreferenced_names = {entry.name for entry in unreferenced}
    least_used = [entry for entry in idle if entry.kind == "kernel" and entry.name not in unreferenced_names]
    plan = []
    for reason, candidates in ((UNREFERENCED, unreferenced), (LEAST_RECENTLY_USED, least_used)):
        for entry in sorted(candidates, key=lambda e: e.last_used):
            if excess <= 0:
                return plan
            plan.append(Removal(entry, reason))
            excess -= entry.bytes
    return plan


def enforce_budget(
    store: KernelStore,
    budget_bytes: int,
    *,
    referenced_kernels: set[str],
    referenced_weights: set[str],
    in_use: set[str],
    grace_seconds: float,
    now: float | None = None,
) -> tuple[list[Removal], int]:
    """Touch what is in use, then remove what :func:`plan_removals` picks. Returns the removals made
    and the store's bytes after them."""
    touch(store, in_use)
    entries = store_entries(store)
    plan = plan_removals(
        entries,
        budget_bytes,
        referenced_kernels=referenced_kernels,
        referenced_weights=referenced_weights,
        in_use=in_use,
        grace_seconds=grace_seconds,
        now=time.time() if now is None else now,
    )
    removed = []
    for removal in plan:
        entry = removal.entry
        gone = store.delete(entry.name) if entry.kind == "kernel" else store.delete_prepared(entry.name)
        if gone:  # a peer's sweep may have removed it first
            removed.append(removal)
    remaining = sum(entry.bytes for entry in entries) - sum(removal.entry.bytes for removal in removed)
    return removed, remaining
