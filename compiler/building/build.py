"""Compile one (model, bucket, target) into the artifact store, or reuse it.

The caller's process never imports TVM's compile side: the build
(:mod:`compiler.tvm.build`) runs in a child process (see
:mod:`compiler.building.worker`) and lands in the store atomically.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import CompileTimeoutError, NotFoundError
from ..explaining.explain_profile import ProfileJob, profile_stored
from ..explaining.explain_report import REPORT_FILE
from ..models.model import LoadedModel
from ..models.weights import load_weights
from ..running.engines import TvmEngine
from ..shapes.buckets import Bucket
from ..storage.store import (
    EXPLAIN_DIR,
    LIBRARY_NAME,
    KernelStore,
    LeaseTimeoutError,
    Manifest,
    artifact_key,
    tvm_version,
)
from .options import BuildJob, CompileOptions, PrepareJob, read_source
from .worker import run_in_child

LEASE_WAIT_FACTOR = 2.0
"""Another process building the same kernel is waited for up to this many times the compile timeout."""
TUNING_SHARE = 0.75
"""Of a tuning compile's time limit, what tuning may take: the build and verification need the rest."""


@dataclass(frozen=True)
class CompileOutcome:
    manifest: Manifest
    cached: bool
    library_path: str
    built_elsewhere: bool = False
    """Another process on the store built it while this one waited for the key's lease."""
    waited_seconds: float = 0.0
    took_over_from: str | None = None
    """Who held the key's lease before this process built it (and ended without a kernel: died or failed)."""


def bucket_key(
    graph_digest: str,
    bucket: Bucket,
    *,
    target: dict,
    options: CompileOptions,
    verify_sizes: dict[str, list[int]] | None = None,
) -> str:
    """The artifact key. A symbolic bucket's verification sizes are part of it: they bound the range its
    tiles are planned for and what its verdict holds for."""
    key_options = options.key_options()
    if verify_sizes:
        key_options["verify_sizes"] = {name: sorted(sizes) for name, sizes in sorted(verify_sizes.items())}
    return artifact_key(graph_digest, bucket, target, tvm_version(), key_options)


def _build_in_child(job: BuildJob) -> dict:
    from ..tvm.build import build_and_verify

    return build_and_verify(job)


def _prepare_in_child(job: PrepareJob) -> dict:
    from ..tvm.prepare import prepare

    return prepare(read_source(job.model_source), Path(job.directory), job.simplify)


def model_source(model: LoadedModel) -> bytes | str:
    """What a child reads the model from: its stored file when the caller let go of the bytes."""
    return str(model.path) if model.data is None and model.path is not None else model.read_bytes()


def ensure_prepared(
    model: LoadedModel, store: KernelStore, options: CompileOptions | None = None, *, preparer=_prepare_in_child
) -> tuple[Path, str | None]:
    """The model version's prepared folder (weights folded and split off once), written by a child
    the first time; one process prepares it while its peers on the store wait. Also returns who held
    the preparation's lease before this process prepared it (and ended without: died or failed)."""
    options = options or CompileOptions()
    directory = store.prepared_path(model.digest)
    if store.has_prepared(model.digest):
        return directory, None
    try:
        lease = store.lease(
            f"prepare-{model.digest}",
            max_wait=options.timeout_seconds * LEASE_WAIT_FACTOR,
            what="prepare",
            done=lambda: store.has_prepared(model.digest),
        )
        with lease as held:
            if not held.held or store.has_prepared(model.digest):
                return directory, None
            with store.staging(f"prepare-{model.digest}") as staging:
                job = PrepareJob(model_source(model), str(staging), options.simplify)
                run_in_child(
                    preparer,
                    job,
                    timeout=options.timeout_seconds,
                    what="weight preparation",
                    **options.child_limits(),
                )
                store.commit_prepared(staging, model.digest)
    except LeaseTimeoutError as exc:
        raise CompileTimeoutError(str(exc)) from None
    return directory, held.holder


def compile_bucket(
    model: LoadedModel,
    bucket: Bucket,
    target: dict,
    store: KernelStore,
    options: CompileOptions | None = None,
    *,
    builder=_build_in_child,
    progress_path: str | None = None,
    verify_sizes: dict[str, list[int]] | None = None,
    kernel_times: dict[str, tuple[float | None, float | None]] | None = None,
) -> CompileOutcome:
    """Return the stored artifact for this key, compiling it first if needed.

    ``builder`` runs in the child; tests pass one that crashes on purpose.
    A tuning compile writes its progress to ``progress_path`` as it goes, and tunes first the kernels
    that lose most in ``kernel_times`` (the untuned kernel's explain profile, :func:`profile_kernel`).
    A dim given as a name (``{"x": (1, 3, 48, "W")}``) stays symbolic: the
    dynamic-shape tier, one kernel for every size of it, verified at each of
    ``verify_sizes[name]``.
    """
    options = options or CompileOptions()
    bucket = {name: tuple(d if isinstance(d, str) else int(d) for d in shape) for name, shape in bucket.items()}
    # A stored kernel needs this version's weights too; a dead peer's preparation taken over counts as
    # a lease takeover of this compile.
    prepared, prepare_taken_from = ensure_prepared(model, store, options)
    key = bucket_key(model.graph_digest, bucket, target=target, options=options, verify_sizes=verify_sizes)
    existing = store.get(key)
    if existing is not None:
        return CompileOutcome(existing, True, str(store.library_path(key)))
    try:
        with store.lease(key, max_wait=options.timeout_seconds * LEASE_WAIT_FACTOR) as lease:
            existing = store.get(key)  # committed while this process waited for the lease
            if existing is not None:
                path = str(store.library_path(key))
                return CompileOutcome(existing, True, path, built_elsewhere=True, waited_seconds=lease.waited_seconds)
            signature = model.signature
            with store.staging(key) as staging:
                job = BuildJob(
                    model_source=model_source(model),
                    prepared_dir=str(prepared),
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
                    shipped_tuning=options.shipped_tuning,
                    rpc_tracker=options.rpc_tracker,
                    rpc_key=options.rpc_key,
                    index_limits=model.index_bounds.limits,
                    progress_path=progress_path,
                    tune_seconds=options.timeout_seconds * TUNING_SHARE,
                    kernel_times=kernel_times,
                    verify_sizes=verify_sizes,
                    explain_dir=str(staging / EXPLAIN_DIR) if options.explain else None,
                    explain_code=options.explain_code,
                    budget=options.budget.model_dump() if options.budget else None,
                    precision=options.precision,
                    cuda_graph=options.cuda_graph,
                )
                facts = run_in_child(
                    builder,
                    job,
                    timeout=options.timeout_seconds,
                    **options.child_limits(),
                )
                manifest = Manifest(
                    key=key,
                    graph_digest=model.graph_digest,
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
            path, waited = str(store.library_path(key)), lease.waited_seconds
            took_over = lease.holder or prepare_taken_from
            return CompileOutcome(manifest, False, path, waited_seconds=waited, took_over_from=took_over)
    except LeaseTimeoutError as exc:
        raise CompileTimeoutError(str(exc)) from None


def open_kernel(model: LoadedModel, outcome: CompileOutcome, store: KernelStore, device: str = "llvm") -> TvmEngine:
    """A compiled bucket ready to run outside the server: its library with the model version's weights."""
    weights = load_weights(store.prepared_path(model.digest))
    signature = model.signature
    return TvmEngine(
        outcome.library_path,
        signature.input_names,
        signature.output_names,
        device=device,
        weights=[weights[name] for name in outcome.manifest.weights],
    )


def profile_job(
    model: LoadedModel,
    manifest: Manifest,
    store: KernelStore,
    explain_dir: Path,
    shapes: dict[str, list[int]],
    *,
    runs: int = 10,
    threads: int | None = None,
) -> ProfileJob:
    """The job of profiling a stored kernel into the explain bundle at ``explain_dir``, on inputs of ``shapes``."""
    signature = model.signature
    return ProfileJob(
        model_source=model_source(model),
        library=str(store.library_path(manifest.key)),
        weights_dir=str(store.prepared_path(model.digest)),
        weight_names=list(manifest.weights),
        input_names=signature.input_names,
        output_names=signature.output_names,
        shapes=shapes,
        dtypes={s.name: s.dtype for s in signature.inputs},
        index_limits=model.index_bounds.limits,
        explain_dir=str(explain_dir),
        runs=runs,
        threads=threads,
        device=manifest.target["kind"],
    )


def profile_kernel(
    model: LoadedModel,
    manifest: Manifest,
    store: KernelStore,
    shapes: dict[str, list[int]],
    options: CompileOptions,
    *,
    runs: int = 10,
    threads: int | None = None,
    timeout: float = 120.0,
) -> dict:
    """Time a stored kernel kernel by kernel beside ONNX Runtime's nodes on inputs of ``shapes``, in a child
    (below serving, as ``options`` says); the profile is written into its explain bundle and returned."""
    directory = store.library_path(manifest.key).parent / EXPLAIN_DIR
    if not (directory / REPORT_FILE).is_file():
        raise NotFoundError(f"kernel {manifest.key[:16]} has no explain bundle to profile")
    job = profile_job(model, manifest, store, directory, shapes, runs=runs, threads=threads)
    return run_in_child(profile_stored, job, timeout=timeout, what="profile", **options.child_limits())
