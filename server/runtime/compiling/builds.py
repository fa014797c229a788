"""What the compile workers and the tuner do to a bucket: build a tier (the
plain kernel, or a tuned one), then load it and route. Both share one build
step: compile in a child (or find the kernel stored), record the metrics,
refuse what did not verify."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from compiler.building.build import CompileOutcome, compile_bucket
from compiler.building.matrix_units import host_matrix_units
from compiler.building.options import CompileOptions
from compiler.building.target import canonical_target, target_kind
from compiler.errors import CompileCrashedError, CompileTimeoutError, JitServeError
from compiler.measuring.tuning_plan import kernel_times
from compiler.running.engines import Engine
from compiler.storage.store import COMPILER_VERSION

from ...settings import Settings
from ..memory.kernel_cache import Kernels
from ..models.registry import ServedModel
from ..models.state import BF16_TIER, BucketState, CompileEvent, ServedBucket, TuningState, TuningStatus
from ..observability.metrics import Metrics
from .progress import TuningWatch
from .router import Router, held_apart

log = logging.getLogger("jitserve")

CompileFunction = Callable[..., CompileOutcome]


DYNAMIC_TIER = "tvm-dynamic"
"""The ``tier`` label of a dynamic bucket's compiles (one symbolic kernel per size range)."""


def integer_refusal(served: ServedModel) -> str | None:
    """Why a quantized model's buckets get no TVM compile; None where they do (or it is not quantized): its
    integer ops kept in integers (``compiler.tvm.integer_matmul``, ``integer_conv``), on a CPU with an int8
    unit, and a contract that allows int8, whose budget judges the kernels. Not fp32's tolerances: a quantization
    turns the last bits of float reassociation into whole steps (a dynamically quantized 12-layer encoder
    with 7-bit weights, exact in both engines' integer products, ended 0.08 off ONNX Runtime), and ONNX
    Runtime's AVX2 kernels saturate the sums of some 8-bit weights' pairs where these are exact."""
    model, contract = served.model, served.record.config.precision
    if not model.integer_ops:
        return None
    if model.integer_refusal:
        return f"{model.integer_refusal}, which the compiled tier would run in float"
    if target_kind(served.target) != "llvm":
        return "the compiled tier keeps integers in integers on the CPU only"
    missing = host_matrix_units().missing("int8")
    if missing:
        return missing
    if contract is None or "int8" not in contract.allow:
        return "its integer rounding is not ONNX Runtime's: a precision contract that allows int8 lets it compete"
    return None


def bf16_refusal(served: ServedModel, bucket: ServedBucket, mode: str) -> str | None:
    """Why the bucket gets no TVM bf16 kernel though its model's contract allows bf16; None where it does
    (``mode``: the ``tvm_bf16`` setting)."""
    if mode == "off":
        return "TVM's bf16 tier is off (tvm_bf16)"
    if target_kind(served.target) != "llvm":
        return "TVM's bf16 kernels are CPU kernels"
    if bucket.symbolic:
        return "the dynamic tier compiles fp32 kernels only"
    if served.model.integer_ops:
        return "a quantized graph's contractions are computed in integers"
    return host_matrix_units().missing("bf16") if mode == "unit" else None


def contract_allows_bf16(served: ServedModel) -> bool:
    contract = served.record.config.precision
    return contract is not None and "bf16" in contract.allow


@dataclass(frozen=True)
class TierBuild:
    """The result of one build step: a verified outcome, or why the tier cannot serve."""

    outcome: CompileOutcome | None
    failure: str | None
    seconds: float
    transient: bool = False
    """The failure may pass: the child was killed, crashed or timed out."""


class BucketBuilder:
    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        kernels: Kernels,
        router: Router,
        *,
        compile_function: CompileFunction = compile_bucket,
        tuning_profile: Callable[[ServedModel, ServedBucket], dict | None] = lambda *_: None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.kernels = kernels
        self.router = router
        self._compile = compile_function
        self._tuning_profile = tuning_profile

    def _build(self, served: ServedModel, bucket: ServedBucket, options: CompileOptions, **extra) -> TierBuild:
        """Compile (or find) the tier, record its compile metrics, and check that it verified."""
        name, kind, tier = served.name, target_kind(served.target), options.tier
        started = time.perf_counter()
        if bucket.symbolic:  # the dynamic-shape tier: verified at its range's ends, middle and tails
            extra["verify_sizes"] = bucket.verify_sizes
            tier = DYNAMIC_TIER
        try:
            artifacts = self.kernels.artifacts
            outcome = self._compile(served.model, bucket.bucket, served.target, artifacts, options, **extra)
        except JitServeError as exc:
            self.metrics.compiles.record_compile(model=name, target=kind, tier=tier, outcome="error", seconds=None)
            log.warning("%s of %s %s failed: %s", tier, name, bucket.label, exc)
            transient = isinstance(exc, CompileCrashedError | CompileTimeoutError)
            return TierBuild(None, str(exc), time.perf_counter() - started, transient)
        manifest = outcome.manifest
        if outcome.built_elsewhere:
            self.metrics.fleet.record_peer_build(tier=tier, seconds=outcome.waited_seconds)
            log.info("%s %s %s was built by another process; waited %.1fs", tier, name, bucket.label,
                     outcome.waited_seconds)  # fmt: skip
        if outcome.took_over_from:
            self.metrics.fleet.record_lease_takeover()
            log.warning("%s %s %s: took over the build lease from %s after %.1fs", tier, name, bucket.label,
                        outcome.took_over_from, outcome.waited_seconds)  # fmt: skip
        if not outcome.cached:
            verdict = "ok" if manifest.verified else "verify_failed"
            unscheduled = manifest.unscheduled
            self.metrics.compiles.record_compile(
                model=name,
                target=kind,
                tier=tier,
                outcome=verdict,
                seconds=manifest.compile_seconds,
                unscheduled=len(unscheduled),
            )
            self.metrics.compiles.record_stages(model=name, stages=manifest.compile_stages or {})
            if unscheduled:
                log.warning("%s %s %s: no schedule rule took %d kernels (naive loops): %s", tier, name,
                            bucket.label, len(unscheduled), ", ".join(unscheduled[:8]))  # fmt: skip
            log.info("built %s %s %s in %.1fs (%s)", tier, name, bucket.label, manifest.compile_seconds, verdict)
        failure = None if manifest.verified is True else f"verification against onnxruntime: {manifest.verification}"
        return TierBuild(outcome, failure, time.perf_counter() - started)

    def compile(self, served: ServedModel, bucket: ServedBucket) -> None:
        """Make the bucket's kernel available: compile (or find it stored), load; build OpenVINO where it is
        enabled; measure every verified engine and route. Fails only where no engine but ONNX Runtime can
        serve it."""
        if not bucket.move(BucketState.COMPILING, only_from=BucketState.ADMITTED):
            return
        unchecked = served.model.index_bounds.unchecked
        if unchecked:  # a kernel would read out of bounds on some input ONNX Runtime refuses
            bucket.fail(f"not compiled: {unchecked[0].describe()}; onnxruntime serves it")
            return
        built: TierBuild | None = None
        candidates: dict[str, Engine] = {}
        refusal = integer_refusal(served)
        if refusal:  # no compile spent where TVM can only lose (compiler/models/quantized.py)
            failure = f"not compiled: a quantized graph ({', '.join(served.model.integer_ops)}): {refusal}"
        else:
            built = self._compile_tvm(served, bucket)
            failure = built.failure
            if built.outcome is not None and failure is None:
                if built.outcome.cached and self.router.restore(served, bucket):
                    return
                candidates["tvm"] = self.kernels.open(served, bucket.key)
            if contract_allows_bf16(served):
                candidates.update(self._bf16(served, bucket))
        openvino = self._openvino(served, bucket)
        candidates.update(openvino)
        if not candidates:
            if built is not None and built.outcome is None:
                self._fail(served, bucket, built)  # a compile failure that may pass is retried
            else:
                if served.model.integer_ops:
                    failure += "; onnxruntime serves it with its int8 kernels"
                bucket.fail(with_openvino_failure(bucket, failure))
            return
        route = self.router.route(served, bucket, candidates, unavailable=failure)
        for name in candidates:
            if name != route and held_apart(name):
                self.kernels.drop(served, bucket.key_for(name))  # measured slower: its memory goes back

    def _compile_tvm(self, served: ServedModel, bucket: ServedBucket) -> TierBuild:
        """Compile (or find stored) and load the bucket's TVM kernel; the build carries why it cannot serve."""
        reason = recompile_reason(served, bucket) if self.kernels.artifacts.get(bucket.key) is None else None
        bucket.attempts += 1
        self.metrics.compiles.record_retry(model=served.name, retried=False)
        built = self._build(served, bucket, served.options)
        outcome = built.outcome
        if outcome is None:
            return built
        bucket.compiled(outcome.manifest.compile_seconds)
        if not outcome.cached:
            remember_compile(served, bucket, outcome, reason or "first_compile")
        if reason and not outcome.cached:
            self.metrics.compiles.record_recompile(model=served.name, reason=reason)
        if built.failure:
            return built
        if outcome.cached:
            self.metrics.kernels.record_reload(model=served.name)
        try:
            self.kernels.load(served, bucket.key)
        except JitServeError as exc:  # its weights do not fit the kernel: never served
            return dataclasses.replace(built, failure=str(exc))
        return built

    def _bf16(self, served: ServedModel, bucket: ServedBucket) -> dict[str, Engine]:
        """TVM's bf16 kernel of the bucket, verified within the contract's budget and loaded, as a routing
        candidate; nothing where it cannot serve (``bucket.bf16`` says why)."""
        refusal = bf16_refusal(served, bucket, self.settings.tvm_bf16)
        if refusal:
            bucket.bf16 = {"failure": f"not compiled: {refusal}"}
            return {}
        contract = served.record.config.precision
        options = served.options.model_copy(update={"precision": "bf16", "budget": contract.budget})
        built = self._build(served, bucket, options)
        if built.outcome is None:
            bucket.bf16 = {"failure": built.failure}
            return {}
        manifest = built.outcome.manifest
        facts = {"key": manifest.key, "verification": manifest.verification}
        in_bf16 = [name for name in manifest.schedules or {} if "bf16" in name]
        failure = built.failure or (None if in_bf16 else "no matmul or conv by a weight of this bucket is in bf16")
        if failure is None:
            try:
                self.kernels.load(served, manifest.key)
                bucket.bf16 = {**facts, "kernels_in_bf16": len(in_bf16)}
                return {BF16_TIER: self.kernels.open(served, manifest.key)}
            except JitServeError as exc:
                failure = str(exc)
        log.warning("%s %s: %s: %s", served.name, bucket.label, BF16_TIER, failure)
        bucket.bf16 = {**facts, "failure": failure}
        return {}

    def _openvino(self, served: ServedModel, bucket: ServedBucket) -> dict[str, Engine]:
        """OpenVINO built, verified and held for the bucket where it is enabled, in fp32 and in each reduced
        precision the model's contract allows; those that failed are left out (the bucket says why)."""
        openvino = self.kernels.openvino
        if openvino is None or not openvino.takes(served, bucket):
            return {}
        engines = {}
        for precision in openvino.precisions(served):
            engine = openvino.build(served, bucket, precision).engine
            if engine is not None:
                # In the cache before it may be routed to: a request that finds it routed finds it loaded.
                self.kernels.hold(served, bucket.key_for(engine.name), engine, engine.nbytes)
                engines[engine.name] = engine
        return engines

    def tune(self, served: ServedModel, bucket: ServedBucket) -> float:
        """Tune a ready bucket (background, budgeted), verify, re-measure, hot-swap the route.

        Returns the seconds spent. Requests keep being served throughout: the
        route changes in one assignment and in-flight requests finish on the
        engine they started with.
        """
        s = self.settings
        options = served.options.model_copy(
            update={
                "tune_trials": s.tune_trials_per_bucket,
                "tune_trials_per_task": s.tune_trials_per_task,
                "timeout_seconds": s.tuning_seconds_per_bucket,
                "rpc_tracker": s.tuning_rpc_tracker,
                "rpc_key": s.tuning_rpc_key,
            }
        )
        bucket.set_tuning(TuningStatus(state=TuningState.TUNING, trials=0, seconds=0.0))
        ranking = kernel_times(self._tuning_profile(served, bucket))  # the kernels that lose most go first
        progress_path = self.kernels.artifacts.staging_area.entry("progress", ".json")
        watch = TuningWatch(progress_path, bucket, self.metrics, model=served.name)
        watch.start()
        try:
            built = self._build(served, bucket, options, progress_path=str(watch.path), kernel_times=ranking)
        finally:
            live = watch.stop()
        outcome = built.outcome
        if outcome is not None and not outcome.cached:
            remember_compile(served, bucket, outcome, "tuned")
        facts = (outcome.manifest.tuning if outcome else None) or {}
        if outcome is None or not outcome.cached:
            rest = max(0, facts.get("trials", 0) - live.trials)  # the trials not yet counted while it ran
            self.metrics.compiles.record_tuning(model=served.name, trials=rest, seconds=built.seconds)
        status = TuningStatus(
            state=TuningState.FAILED if built.failure else TuningState.DONE,
            trials=facts.get("trials") if outcome else None,
            best_ms=live.best_ms,
            tasks=facts.get("tasks"),
            seconds=round(facts.get("tune_seconds", built.seconds), 1),
            reason=built.failure,
            measured_on=facts.get("measured_on"),
            plan=facts.get("plan"),
        )
        if built.failure:
            bucket.set_tuning(status)
            self.router.remember(served, bucket)
            return built.seconds
        # Known as tuned now (its key), done once its route is decided: whoever sees "done" sees the route.
        bucket.set_tuning(bucket.tuning, tuned_key=outcome.manifest.key)
        serving = bucket.route or ""
        try:
            self.kernels.load(served, outcome.manifest.key)
            candidates = {  # timed as fresh instances: the live kernel serves meanwhile, undisturbed
                tier: self.kernels.open(served, key)
                for tier, key in (("tvm", bucket.key), ("tvm-tuned", outcome.manifest.key))
            }
            # A tier the tuned kernel may replace:
            held = self.kernels.get(served, bucket.key_for(serving) or "") if held_apart(serving) else None
            if held is not None:  # built and held: it serves the bucket now, and is timed as it is
                candidates[serving] = held
            routed = self.router.route(served, bucket, candidates)
        finally:
            bucket.set_tuning(status)
            self.router.remember(served, bucket)
        if routed != serving and held is not None:
            self.kernels.drop(served, bucket.key_for(serving))  # the tuned kernel won: its memory goes back
        return built.seconds

    def _fail(self, served: ServedModel, bucket: ServedBucket, built: TierBuild) -> None:
        """Failed; a failure that may pass is retried (by the scheduler) after a doubling wait, a few times."""
        reason = built.failure or "compile failed"
        retries = self.settings.compile_retries
        if not built.transient or bucket.attempts > retries or served.retired:
            tried = f" (tried {bucket.attempts} times)" if built.transient and bucket.attempts > 1 else ""
            bucket.fail(reason + tried)
            return
        delay = self.settings.compile_retry_seconds * 2 ** (bucket.attempts - 1)
        self.metrics.compiles.record_retry(model=served.name)
        bucket.fail(f"{reason}; retry {bucket.attempts} of {retries} in {delay:g} s", retry_in=delay)


def with_openvino_failure(bucket: ServedBucket, failure: str) -> str:
    """``failure`` followed by why each of the bucket's OpenVINO engines could not serve it."""
    failures = [facts["failure"] for facts in (bucket.openvino or {}).values() if facts.get("failure")]
    return "; ".join([failure, *failures])


def remember_compile(served: ServedModel, bucket: ServedBucket, outcome: CompileOutcome, reason: str) -> None:
    """The bucket's compile history: what its key was made of, to tell what a recompile changed."""
    manifest = outcome.manifest
    facts = {
        "model version": served.record.version,
        "graph": manifest.graph_digest[:16],
        "target": canonical_target(manifest.target),
        "TVM": manifest.tvm_version,
        "compiler version": COMPILER_VERSION,
        "tuning": json.dumps(manifest.options.get("tune")),
    }
    bucket.add_compile(
        CompileEvent(at=time.time(), reason=reason, key=manifest.key, facts=facts,
                     compile_seconds=round(manifest.compile_seconds, 3), verified=manifest.verified)
    )  # fmt: skip


def recompile_reason(served: ServedModel, bucket: ServedBucket) -> str | None:
    """Why a bucket compiled before is compiled again (its stored kernel gone, a new version, another key);
    None for its first compile."""
    previous = served.record.buckets.get(bucket.label)
    if previous is None:
        return None
    if previous.key == bucket.key:
        return "artifact_missing"
    if previous.model_version != served.record.version:
        return "new_model_version"
    return "target_or_compiler_changed"
