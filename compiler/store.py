"""Content-addressed artifact store for compiled kernels.

An artifact is a directory ``artifacts/<k[:2]>/<key>/`` holding ``kernel.so``
and ``manifest.json``. It is built in ``staging/`` and renamed into place in
one step, so a crash never leaves a half artifact under its key.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path

from pydantic import BaseModel

from .target import canonical_target
from .tvm import COMPILER_VERSION

LIBRARY_NAME = "kernel.so"
MANIFEST_NAME = "manifest.json"


def tvm_version() -> str:
    return version("apache-tvm")


class Manifest(BaseModel):
    key: str
    model_digest: str
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
    created_at: float
    tuning: dict | None = None


def artifact_key(
    model_digest: str, bucket: dict, target: dict, tvm: str, options: dict, *, compiler: str = COMPILER_VERSION
) -> str:
    """sha256 over what determines the kernel: content, never paths (``compiler``: jitserve's own version)."""
    material = {
        "model": model_digest,
        "bucket": {name: list(shape) for name, shape in sorted(bucket.items())},
        "target": canonical_target(target),
        "tvm": tvm,
        "options": options,
        "compiler": compiler,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def process_token(pid: int) -> str:
    """``pid-starttime``: names one process for good. A pid alone comes back after a restart (in a
    container the server is pid 1 every time), and its staging would never be swept."""
    try:
        started = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return f"{pid}-0"
    return f"{pid}-{started}"


def _owner_alive(token: str) -> bool:
    """Whether the process a staging entry names still runs (the very same process, not its pid reused)."""
    pid_text, _, started = token.partition("-")
    try:
        pid = int(pid_text)
    except ValueError:
        return False
    return pid > 0 and Path(f"/proc/{pid}").exists() and process_token(pid) == f"{pid}-{started}"


class ArtifactStore:
    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.artifacts = self.root / "artifacts"
        self.staging_root = self.root / "staging"
        self.artifacts.mkdir(parents=True, exist_ok=True)
        self.staging_root.mkdir(parents=True, exist_ok=True)
        self._token = process_token(os.getpid())
        self._sweep_staging()

    def _sweep_staging(self) -> None:
        """Remove staging dirs left by processes that died mid-compile."""
        for entry in self.staging_root.iterdir():
            parts = entry.name.split(".")
            if len(parts) < 3 or not _owner_alive(parts[1]):
                shutil.rmtree(entry, ignore_errors=True)

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
                doomed = self.staging_root / f"damaged.{self._token}.{uuid.uuid4().hex[:8]}"
                os.rename(entry, doomed)
                shutil.rmtree(doomed, ignore_errors=True)
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

    def keys(self) -> Iterator[str]:
        for shard in self.artifacts.iterdir():
            for entry in shard.iterdir():
                if (entry / MANIFEST_NAME).is_file():
                    yield entry.name

    @contextmanager
    def staging(self, key: str) -> Iterator[Path]:
        """A private directory to build into; removed unless committed."""
        directory = self.staging_root / f"{key[:16]}.{self._token}.{uuid.uuid4().hex[:8]}"
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
        # Rename first so readers never see a half-deleted artifact.
        doomed = self.staging_root / f"deleted.{self._token}.{uuid.uuid4().hex[:8]}"
        os.rename(directory, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        return True
