"""Compile one (model, bucket, target) into the artifact store, or reuse it.

The caller's process never imports TVM for this: the build runs in a child
process (see :mod:`compiler.worker`) and lands in the store atomically.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pydantic import BaseModel, Field

from .buckets import Bucket
from .model import LoadedModel
from .store import LIBRARY_NAME, ArtifactStore, Manifest, artifact_key, tvm_version
from .worker import run_in_child


class CompileOptions(BaseModel):
    """Knobs of one compile. Only ``key_options()`` enter the artifact key."""

    rtol: float = Field(1e-3, description="relative tolerance of verification")
    atol: float = Field(1e-4, description="absolute tolerance of verification")
    seed: int = Field(0, description="seed of the random verification inputs")
    timeout_seconds: float = Field(900.0, description="limit of one compile child process")
    simplify: bool = Field(True, description="fold shape subgraphs with onnxsim before import")
    tune_trials: int = Field(0, ge=0, description="MetaSchedule trials for this bucket (0: no tuning)")
    tune_trials_per_task: int = Field(64, ge=1, description="MetaSchedule trials per task at most")
    database_dir: str | None = Field(None, description="shared tuning database, applied at every compile")

    @property
    def tier(self) -> str:
        return "tvm-tuned" if self.tune_trials else "tvm"

    def key_options(self) -> dict:
        # The database is not in the key: a kernel compiled with whatever records existed is
        # still verified, and keys must stay stable for a restart to find its kernels.
        key = {"simplify": self.simplify, "pipeline": "fuse+tuning-records+default-schedules"}
        if self.tune_trials:
            key["tune"] = [self.tune_trials, self.tune_trials_per_task]
        return key


@dataclass(frozen=True)
class BuildJob:
    """Everything the compile child needs; pickled across the process boundary."""

    model_bytes: bytes
    bucket: Bucket
    dtypes: dict[str, str]
    input_names: list[str]
    output_names: list[str]
    target: dict
    library_path: str
    rtol: float
    atol: float
    seed: int
    simplify: bool
    tune_trials: int = 0
    tune_trials_per_task: int = 64
    database_dir: str | None = None


@dataclass(frozen=True)
class CompileOutcome:
    manifest: Manifest
    cached: bool
    library_path: str


def bucket_key(model: LoadedModel, bucket: Bucket, target: dict, options: CompileOptions) -> str:
    return artifact_key(model.digest, bucket, target, tvm_version(), options.key_options())


def _build_in_child(job: BuildJob) -> dict:
    from .tvm_build import build_and_verify

    return build_and_verify(job)


def compile_bucket(
    model: LoadedModel,
    bucket: Bucket,
    target: dict,
    store: ArtifactStore,
    options: CompileOptions | None = None,
    *,
    builder=_build_in_child,
) -> CompileOutcome:
    """Return the stored artifact for this key, compiling it first if needed.

    ``builder`` runs in the child; tests pass one that crashes on purpose.
    """
    options = options or CompileOptions()
    bucket = {name: tuple(int(d) for d in shape) for name, shape in bucket.items()}
    key = bucket_key(model, bucket, target, options)
    existing = store.get(key)
    if existing is not None:
        return CompileOutcome(existing, True, str(store.library_path(key)))

    signature = model.signature
    with store.staging(key) as staging:
        job = BuildJob(
            model_bytes=model.data,
            bucket=bucket,
            dtypes={s.name: s.dtype for s in signature.inputs},
            input_names=signature.input_names,
            output_names=signature.output_names,
            target=target,
            library_path=str(staging / LIBRARY_NAME),
            rtol=options.rtol,
            atol=options.atol,
            seed=options.seed,
            simplify=options.simplify,
            tune_trials=options.tune_trials,
            tune_trials_per_task=options.tune_trials_per_task,
            database_dir=options.database_dir,
        )
        facts = run_in_child(builder, job, timeout=options.timeout_seconds)
        manifest = Manifest(
            key=key,
            model_digest=model.digest,
            bucket={k: list(v) for k, v in bucket.items()},
            target=target,
            tvm_version=tvm_version(),
            options=options.key_options(),
            rtol=options.rtol,
            atol=options.atol,
            library_bytes=(staging / LIBRARY_NAME).stat().st_size,
            created_at=time.time(),
            **facts,
        )
        manifest = store.commit(staging, manifest)
    return CompileOutcome(manifest, False, str(store.library_path(key)))
