"""Content-addressed artifact store for compiled kernels.

An artifact is a directory ``artifacts/<k[:2]>/<key>/`` holding ``kernel.so``
and ``manifest.json``: code only, since kernels take the weights as
parameters. A model version's prepared weights live once in
``prepared/<model digest>/`` (see :mod:`compiler.models.weights`), shared by every
kernel of the version. Both are built in ``staging/`` and renamed into place
in one step, so a crash never leaves a half artifact under its key.

Several processes (replicas on one shared volume) may use one store: a key is
built by one of them at a time, the holder of its lease (an exclusive file
lock on ``leases/<key>.lock``, released by the kernel when the holder dies),
and the others wait for the artifact and load it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from pydantic import BaseModel

from ..building.target import canonical_target
from ..models.weights import INDEX_NAME
from ..tvm import COMPILER_VERSION

LIBRARY_NAME = "kernel.so"
EXPLAIN_DIR = "explain"
"""A kernel's explain bundle, beside it in its entry (not part of its key)."""
MANIFEST_NAME = "manifest.json"


def tvm_version() -> str:
    return version("apache-tvm")


class Manifest(BaseModel):
    key: str
    graph_digest: str
    """The model's graph without its weights' values (:func:`compiler.models.weights.graph_digest`)."""
    weights: list[str] = []
    """The prepared weights the kernel takes after the model's inputs, in order."""
    bucket: dict[str, list[int | str]]
    """The bucket's shape per input; a name is a dim the kernel keeps symbolic (the dynamic-shape tier)."""
    target: dict
    tvm_version: str
    options: dict
    compile_seconds: float
    compile_stages: dict[str, float] | None = None
    """Wall seconds per stage: load, simplify, import, [tune], the Relax pipeline's stages, codegen,
    export, verify (``compile_seconds`` is their sum but verify)."""
    simplified: bool
    verified: bool | None
    verification: str
    max_abs_error: float | None
    rtol: float
    atol: float
    library_bytes: int
    workspace_bytes: int | None = None
    """Memory a loaded kernel kept after its verification runs beyond its code and the weights (the VM's
    pooled workspace), measured in the compile child on CPU; None where not measured."""
    created_at: float
    tuning: dict | None = None
    schedule_digest: str | None = None
    """sha256 of the kernel's scheduled TIR: the same for every compile that applied the same schedules."""
    schedules: dict[str, str | None] | None = None
    """What scheduled each kernel (TIR function) of the library: a default rule's name (``Contraction``,
    ``RowReduction``, ``Injective``), ``tuning record``, or None where nothing did and it runs as naive
    loops; None for a manifest written before this was recorded."""

    weight_outputs: list[dict] | None = None
    """Per output of the kernel's lifted weight transform (column panels, blocked conv weights, anything
    computed from the weights alone), in the order ``main`` takes them: its ``digest`` and ``bytes``. The
    engine computes each once at load; the kernels of a model version share every output whose digest
    they agree on. None where the kernel takes the prepared weights as they are."""

    cuda_graph: dict | None = None
    """A CUDA kernel compiled with CUDA graphs: how many graphs a call replays, the kernel launches in them
    (``kernels_in_graphs``) and those launched alone; None for any other."""

    @property
    def unscheduled(self) -> list[str]:
        """The kernels no rule and no tuning record scheduled."""
        return [name for name, rule in (self.schedules or {}).items() if rule is None]

    explain_coverage: dict | None = None
    """The explain bundle's count of the graph's compute nodes (Conv, MatMul, ...) and of those traced to a
    kernel; None without a bundle."""


def artifact_key(
    graph_digest: str, bucket: dict, target: dict, tvm: str, options: dict, *, compiler: str = COMPILER_VERSION
) -> str:
    """sha256 over what determines the kernel: content, never paths (``compiler``: jitserve's own version).
    The weights are parameters: their values are not in the key, their names, dtypes and shapes are."""
    material = {
        "graph": graph_digest,
        "bucket": {name: list(shape) for name, shape in sorted(bucket.items())},
        "target": canonical_target(target),
        "tvm": tvm,
        "options": options,
        "compiler": compiler,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


FOREIGN_STAGING_SECONDS = 24 * 3600.0
"""A private entry of another machine's process is removed once this old: its pids mean nothing here."""

LEASE_POLL_SECONDS = 0.2


def host_name() -> str:
    """This machine (a pod, a container) as a private entry's name may hold it: no dots, no ``+``."""
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:63] or "localhost"


def process_token(pid: int) -> str:
    """``host+pid-starttime``: names one process for good. A pid alone comes back after a restart (in a
    container the server is pid 1 every time), and replicas on one volume run on different hosts."""
    try:
        started = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        started = "0"
    return f"{host_name()}+{pid}-{started}"


def owner_alive(token: str, entry: Path) -> bool:
    """Whether the process a private entry names may still use it: the very same process on this host,
    or, for another host's process, an entry younger than :data:`FOREIGN_STAGING_SECONDS`."""
    host, _, local = token.rpartition("+")
    if host and host != host_name():
        try:
            return time.time() - entry.stat().st_mtime < FOREIGN_STAGING_SECONDS
        except OSError:
            return False
    pid_text, _, started = local.partition("-")
    try:
        pid = int(pid_text)
    except ValueError:
        return False
    return pid > 0 and Path(f"/proc/{pid}").exists() and process_token(pid) == f"{host_name()}+{pid}-{started}"


class StagingArea:
    """A directory of private entries named ``<kind>.<owner token>.<random>``, shared by every process on
    the store. At start an entry is removed only once its owner is gone: a crash leaves nothing behind,
    and a replica starting never removes another's build or upload in progress."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.token = process_token(os.getpid())

    def entry(self, kind: str, suffix: str = "") -> Path:
        """A fresh name for a private entry of this process (``kind`` without dots)."""
        return self.directory / f"{kind}.{self.token}.{uuid.uuid4().hex[:8]}{suffix}"

    def discard(self, path: Path) -> None:
        """Remove ``path`` without a half-removed state at its name: renamed here first."""
        doomed = self.entry("deleted")
        os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)

    def sweep(self) -> list[str]:
        """Remove the entries whose owner is gone; returns their names."""
        removed = []
        for entry in self.directory.iterdir():
            parts = entry.name.split(".")
            if len(parts) >= 3 and owner_alive(parts[1], entry):
                continue
            removed.append(entry.name)
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    entry.unlink()
        return removed


@dataclass
class Lease:
    """This process's turn to build a key (``held``), or the wait ended because the artifact appeared."""

    held: bool
    waited_seconds: float
    holder: str | None
    """Who held the lease while this process waited (host, pid), if anyone did."""


class LeaseTimeoutError(TimeoutError):
    pass


class KernelStore:
    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.artifacts = self.root / "artifacts"
        self.prepared = self.root / "prepared"
        self.staging_root = self.root / "staging"
        self.leases = self.root / "leases"
        self.tuning_database = self.root / "tuning"
        """MetaSchedule's database, shared by every bucket and applied at every compile."""
        self.artifacts.mkdir(parents=True, exist_ok=True)
        self.prepared.mkdir(parents=True, exist_ok=True)
        self.leases.mkdir(parents=True, exist_ok=True)
        self.staging_area = StagingArea(self.staging_root)
        self.staging_area.sweep()  # builds of processes that died mid-compile

    def path(self, key: str) -> Path:
        return self.artifacts / key[:2] / key

    def library_path(self, key: str) -> Path:
        return self.path(key) / LIBRARY_NAME

    def get(self, key: str) -> Manifest | None:
        """The manifest of a complete artifact, or None."""
        directory = self.path(key)
        try:
            manifest = Manifest.model_validate_json((directory / MANIFEST_NAME).read_text())
        except (OSError, ValueError):
            return None
        if not (directory / LIBRARY_NAME).is_file():
            return None
        return manifest

    def check(self) -> tuple[int, list[str]]:
        """fsck at start: every artifact directory must hold a manifest naming its own key and the library
        of the size it records; a damaged one (written or cut from outside: atomic commits never leave
        one) is removed, to be compiled again. Returns (artifacts ok, what was removed and why)."""
        ok, removed = 0, []
        for shard in sorted(self.artifacts.iterdir()):
            for entry in sorted(shard.iterdir()) if shard.is_dir() else [shard]:
                problem = self._damage(entry)
                if problem is None:
                    ok += 1
                    continue
                removed.append(f"{entry.name}: {problem}")
                with contextlib.suppress(FileNotFoundError):  # another replica's check removed it first
                    self.staging_area.discard(entry)
        return ok, removed

    @staticmethod
    def _damage(entry: Path) -> str | None:
        if not entry.is_dir():
            return "not an artifact directory"
        try:
            manifest = Manifest.model_validate_json((entry / MANIFEST_NAME).read_text())
        except OSError:
            return "no manifest"
        except ValueError:
            return "unreadable manifest"
        if manifest.key != entry.name:
            return f"manifest names key {manifest.key[:16]}"
        library = entry / LIBRARY_NAME
        if not library.is_file():
            return "no kernel library"
        if library.stat().st_size != manifest.library_bytes:
            return f"kernel library is {library.stat().st_size} bytes, the manifest says {manifest.library_bytes}"
        return None

    def prepared_path(self, model_digest: str) -> Path:
        return self.prepared / model_digest

    def has_prepared(self, model_digest: str) -> bool:
        return (self.prepared_path(model_digest) / INDEX_NAME).is_file()

    def commit_prepared(self, staging_dir: Path, model_digest: str) -> None:
        """Move a prepared folder under its model digest in one rename (a peer's commit wins)."""
        if not (staging_dir / INDEX_NAME).is_file():
            raise FileNotFoundError(f"no {INDEX_NAME} in {staging_dir}")
        if self.has_prepared(model_digest):
            return
        final = self.prepared_path(model_digest)
        if final.exists():  # damaged from outside: no index
            self.staging_area.discard(final)
        try:
            os.rename(staging_dir, final)
        except OSError:
            if not self.has_prepared(model_digest):
                raise

    def delete_prepared(self, model_digest: str) -> bool:
        try:
            self.staging_area.discard(self.prepared_path(model_digest))  # never half-removed under its name
        except FileNotFoundError:
            return False
        return True

    def keys(self) -> Iterator[str]:
        for shard in self.artifacts.iterdir():
            for entry in shard.iterdir() if shard.is_dir() else []:
                if (entry / MANIFEST_NAME).is_file():
                    yield entry.name

    @contextmanager
    def staging(self, key: str) -> Iterator[Path]:
        """A private directory to build into; removed unless committed."""
        directory = self.staging_area.entry(key[:16])
        directory.mkdir()
        try:
            yield directory
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def commit(self, staging_dir: Path, manifest: Manifest) -> Manifest:
        """Move a built artifact under its key in one rename."""
        if not (staging_dir / LIBRARY_NAME).is_file():
            raise FileNotFoundError(f"no {LIBRARY_NAME} in {staging_dir}")
        manifest_path = staging_dir / MANIFEST_NAME
        with open(manifest_path, "w") as handle:
            handle.write(manifest.model_dump_json(indent=2))
            handle.flush()
            os.fsync(handle.fileno())
        final = self.path(manifest.key)
        final.parent.mkdir(parents=True, exist_ok=True)
        existing = self.get(manifest.key)
        if existing is not None:
            return existing  # another process committed the same key first
        if final.exists():
            self.delete(manifest.key)  # damaged from outside (no kernel or bad manifest)
        try:
            os.rename(staging_dir, final)
        except OSError:
            existing = self.get(manifest.key)
            if existing is None:
                raise
            return existing
        return manifest

    def delete(self, key: str) -> bool:
        directory = self.path(key)
        if not directory.exists():
            return False
        try:
            self.staging_area.discard(directory)  # readers never see a half-deleted artifact
        except FileNotFoundError:
            return False  # another process deleted it first
        return True

    @contextmanager
    def lease(
        self, key: str, *, max_wait: float, what: str = "compile", done: Callable[[], bool] | None = None
    ) -> Iterator[Lease]:
        """Wait for the turn to build ``key``: the lease, held until the block ends, or the artifact
        committed by whoever held it (``Lease.held`` False). One builder per key across every process
        on the store; a dead holder's lock is released by the kernel (by the NFS server once the
        holder's host stops renewing), so the next waiter takes over.

        ``done`` tells whether the work is there (default: ``key``'s artifact is committed).
        Raises :class:`LeaseTimeoutError` after ``max_wait`` seconds of another holder."""
        done = done or (lambda: self.get(key) is not None)
        path = self.leases / f"{key}.lock"
        started = time.monotonic()
        holder = None
        while True:
            handle = open(path, "a+")  # noqa: SIM115 - held open for the whole block
            if _try_lock(handle):
                break
            handle.seek(0)
            holder = handle.read().strip() or holder
            handle.close()
            if done():
                yield Lease(False, time.monotonic() - started, holder)
                return
            if time.monotonic() - started > max_wait:
                raise LeaseTimeoutError(
                    f"waited {max_wait:g} s for {holder or 'another process'} to build kernel {key[:16]}"
                )
            time.sleep(LEASE_POLL_SECONDS)
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(json.dumps({"host": host_name(), "pid": os.getpid(), "what": what}))
            handle.flush()
            yield Lease(True, time.monotonic() - started, holder)
        finally:
            if done():
                # Built: whoever opens the file next finds the artifact before building anything.
                with contextlib.suppress(OSError):
                    path.unlink()
            handle.close()


def _try_lock(handle) -> bool:
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True
