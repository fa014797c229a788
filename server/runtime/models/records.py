"""Uploaded models and their records on disk:
``models/<name>/v<version>/{model.onnx,record.json}``, and the upload config.

A version directory is written in ``models/.staging`` and renamed into place,
so a crash never leaves a half-written model; the newest complete version is
the current one, older ones are removed once a new one is in place.

Replicas on one shared volume share the store: versions are numbered, and
records rewritten, under a file lock on ``models/.lock``, so two replicas
never take one version number or lose each other's bucket records.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from compiler.building.options import MAX_ATOL, MAX_RTOL
from compiler.errors import BadRequestError
from compiler.models.model import model_digest
from compiler.models.upload import TOKENIZER_NAME
from compiler.running.precision import PrecisionContract
from compiler.shapes.buckets import AxisPolicy, AxisSafety
from compiler.storage.store import StagingArea

from ..serving.batcher import DynamicBatching
from .state import CompileEvent, TuningStatus

log = logging.getLogger("jitserve")

MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
"""A letter or digit first: names with a leading dot are the store's own (``.staging``) and hidden."""
RESERVED_NAMES = re.compile(r"^(con|prn|aux|nul|com[0-9]|lpt[0-9])(\..*)?$", re.IGNORECASE)
"""Device names that no copy of the store on another file system could hold."""
MODEL_FILE = "model.onnx"
RECORD_FILE = "record.json"


def check_model_name(name: str) -> str:
    if not MODEL_NAME.match(name):
        raise BadRequestError(
            f"invalid model name {name!r}: use 1-64 of A-Z a-z 0-9 _ . -, starting with a letter or digit"
        )
    if RESERVED_NAMES.match(name):
        raise BadRequestError(f"invalid model name {name!r}: a reserved device name")
    return name


class ModelConfig(BaseModel):
    """Per-model serving configuration, sent as the ``config`` part of an upload."""

    model_config = ConfigDict(extra="forbid")

    axes: dict[str, AxisPolicy] = Field(default_factory=dict, description="bucket policy per symbolic axis")
    default_axis_policy: AxisPolicy = Field(
        default_factory=lambda: AxisPolicy(kind="pow2", min=1, max=1024),
        description="policy of symbolic axes not named in `axes`",
    )
    overflow: Literal["error", "exact"] = Field("exact", description="beyond the largest bucket: 400 or exact")
    probe_sizes: dict[str, Annotated[int, Field(ge=1)]] = Field(
        default_factory=dict, description="sizes of symbolic axes for the padding-safety check"
    )
    warm_buckets: list[dict[str, list[Annotated[int, Field(ge=0)]]]] = Field(
        default_factory=list, description="request shapes compiled right after upload"
    )
    pad_values: dict[str, Annotated[float, Field(allow_inf_nan=False)]] = Field(
        default_factory=dict, description="pad value per input (default 0)"
    )
    target: str | None = Field(None, description="llvm, cuda or a JSON target; default from settings")
    rtol: float | None = Field(
        None, gt=0, le=MAX_RTOL, allow_inf_nan=False, description="verification rtol, in (0, 1]; default from settings"
    )
    atol: float | None = Field(
        None, gt=0, le=MAX_ATOL, allow_inf_nan=False, description="verification atol, in (0, 1]; default from settings"
    )
    dynamic_batching: DynamicBatching | None = Field(
        None, description="join concurrent requests along the batch axis into one run (off when absent)"
    )
    precision: PrecisionContract | None = Field(
        None,
        description="reduced precisions that may serve the model, and the accuracy budget they keep against "
        "fp32 onnxruntime (absent: only fp32-exact engines serve)",
    )
    weight: float = Field(
        1.0, gt=0, le=1000, allow_inf_nan=False,
        description="the model's share of the inference threads while models compete for them (weighted fair "
        "queueing: a model of weight 2 starts two runs for each of a weight-1 model's)",
    )  # fmt: skip

    def policy_for(self, axis: str) -> AxisPolicy:
        return self.axes.get(axis, self.default_axis_policy)


class BucketRecord(BaseModel):
    """A bucket compiled for some version: tells a recompile from a first compile."""

    key: str
    model_version: int
    latency_ms: dict[str, float] = Field(default_factory=dict)
    throughput_rps: dict[str, float] = Field(default_factory=dict)
    padded_error: dict[str, float] = Field(default_factory=dict)
    route: str | None = None
    reason: str | None = None
    """Why the route is what it is, if something kept a faster engine off (the padding gate, a demotion)."""
    demoted: dict[str, str] = Field(default_factory=dict)
    """Kernel key -> why a shadow check took it off the bucket: never routed again."""
    tuned_key: str | None = None
    tuning: TuningStatus | None = None
    bf16: dict | None = None
    """TVM's bf16 kernel of the bucket: its key and verification, or why it cannot serve."""
    history: list[CompileEvent] = Field(default_factory=list)
    """Its compiles, oldest first (the last few)."""

    @property
    def stored_keys(self) -> list[str]:
        """The store keys of its compiled kernels: fp32, tuned, bf16."""
        return [key for key in (self.key, self.tuned_key, (self.bf16 or {}).get("key")) if key]

    @field_validator("tuning", mode="before")
    @classmethod
    def _untuned(cls, value):
        return value or None  # records written before tuning was typed hold {} for "never tuned"


class ModelRecord(BaseModel):
    name: str
    version: int
    digest: str
    config: ModelConfig
    safety: dict[str, AxisSafety]
    probe_version: int = 1
    """The padding probe that made ``safety`` (``compiler.shapes.padding.PROBE_VERSION``); records from before it
    was kept made theirs with version 1. ``UNPROBED`` while the probe, which runs after the upload answers, has
    not ended (``safety`` then holds only the verdicts the policies give alone)."""
    created_at: float
    buckets: dict[str, BucketRecord] = Field(default_factory=dict)


UNPROBED = 0
"""``ModelRecord.probe_version`` of a record whose padding probe has not ended: probed again at the next start."""


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


class ModelStore:
    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.staging_area = StagingArea(self.root / ".staging")
        self.staging_area.sweep()  # uploads and versions half-written by processes that died
        self.staging = self.staging_area.directory
        self._thread_lock = threading.Lock()

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The store to this thread alone, across every process on it. Not reentrant."""
        with self._thread_lock, open(self.root / ".lock", "a+") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _versions(self, name: str) -> list[int]:
        # A name no upload could take is never stored: and never a path (too long, or the store's own).
        if not MODEL_NAME.match(name):
            return []
        directory = self.root / name
        if not directory.is_dir():
            return []
        found = []
        for entry in directory.iterdir():
            if entry.name.startswith("v") and entry.name[1:].isdigit() and (entry / RECORD_FILE).is_file():
                found.append(int(entry.name[1:]))
        return sorted(found)

    def _dir(self, name: str, version: int) -> Path:
        return self.root / name / f"v{version}"

    def latest_version(self, name: str) -> int | None:
        versions = self._versions(name)
        return versions[-1] if versions else None

    def names(self) -> list[str]:
        """Every stored model, served or not."""
        return sorted(self.current_versions())

    def current_versions(self) -> dict[str, int]:
        """Every stored model's newest version: what a replica compares to notice another one's changes."""
        found = {}
        for entry in self.root.iterdir():
            if not entry.name.startswith(".") and MODEL_NAME.match(entry.name):
                version = self.latest_version(entry.name)
                if version is not None:
                    found[entry.name] = version
        return found

    def tokenizer(self, record: ModelRecord) -> bytes | None:
        """The stored version's ``tokenizer.json``; None where it was uploaded without one."""
        try:
            return (self._dir(record.name, record.version) / TOKENIZER_NAME).read_bytes()
        except FileNotFoundError:
            return None

    def model_path(self, record: ModelRecord) -> Path:
        """Where a stored version's model bytes are (compile children read them there)."""
        return self._dir(record.name, record.version) / MODEL_FILE

    def load(self, name: str) -> tuple[ModelRecord, bytes] | None:
        """The newest complete version of ``name``; None when there is none or it is damaged."""
        versions = self._versions(name)
        if not versions:
            return None
        directory = self._dir(name, versions[-1])
        try:
            record = ModelRecord.model_validate_json((directory / RECORD_FILE).read_text())
            data = (directory / MODEL_FILE).read_bytes()
        except (OSError, ValueError) as exc:
            # One damaged model must not keep the others from being served.
            log.error("skipping stored model %s: %s", directory, exc)
            return None
        if model_digest(data) != record.digest:
            log.error("skipping stored model %s: its bytes do not match the digest its record holds", directory)
            return None
        return record, data

    def current_records(self) -> list[ModelRecord]:
        """Every stored model's newest record, without its bytes (unreadable ones skipped)."""
        records = []
        for name, version in self.current_versions().items():
            with contextlib.suppress(OSError, ValueError):
                text = (self._dir(name, version) / RECORD_FILE).read_text()
                records.append(ModelRecord.model_validate_json(text))
        return records

    def load_all(self) -> tuple[list[tuple[ModelRecord, bytes]], int]:
        """Every stored model's current version, and how many were skipped as damaged (logged)."""
        names = self.names()
        found = [loaded for name in names if (loaded := self.load(name)) is not None]
        return found, len(names) - len(found)

    def save(self, record: ModelRecord, data: bytes, tokenizer: bytes | None = None) -> None:
        """Write a new version in one rename, with its ``tokenizer.json`` where it has one, then drop the older
        versions (hold :meth:`locked`)."""
        staged = self.staging_area.entry("version")
        staged.mkdir()
        (staged / MODEL_FILE).write_bytes(data)
        if tokenizer is not None:
            (staged / TOKENIZER_NAME).write_bytes(tokenizer)
        _write_atomic(staged / RECORD_FILE, record.model_dump_json(indent=2))
        (self.root / record.name).mkdir(exist_ok=True)
        os.rename(staged, self._dir(record.name, record.version))
        for version in self._versions(record.name)[:-1]:
            with contextlib.suppress(FileNotFoundError):
                self.staging_area.discard(self._dir(record.name, version))

    def update_bucket(self, record: ModelRecord, label: str) -> None:
        """Persist one bucket's record into the stored version, keeping the buckets other replicas
        recorded there since this one read it."""

        def put_bucket(stored: ModelRecord) -> None:
            stored.buckets[label] = record.buckets[label]

        self._rewrite(record, put_bucket)

    def update_fields(self, record: ModelRecord, *fields: str) -> None:
        """Persist some of a record's own fields into the stored version (``buckets`` whole, if named)."""

        def copy_fields(stored: ModelRecord) -> None:
            for field in fields:
                setattr(stored, field, getattr(record, field))

        self._rewrite(record, copy_fields)

    def _rewrite(self, record: ModelRecord, change: Callable[[ModelRecord], None]) -> None:
        """Read the stored version's record, ``change`` it in place and write it back, under the store's lock."""
        with self.locked():
            directory = self._dir(record.name, record.version)
            try:
                stored = ModelRecord.model_validate_json((directory / RECORD_FILE).read_text())
            except (OSError, ValueError):
                return  # replaced or deleted meanwhile: the record goes with its version
            if stored.digest != record.digest:
                return  # deleted, and another model uploaded under the same number
            change(stored)
            _write_atomic(directory / RECORD_FILE, stored.model_dump_json(indent=2))

    def delete(self, name: str) -> None:
        """Remove every version of ``name`` (hold :meth:`locked`)."""
        directory = self.root / name
        if MODEL_NAME.match(name) and directory.is_dir():
            with contextlib.suppress(FileNotFoundError):
                self.staging_area.discard(directory)
