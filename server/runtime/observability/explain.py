"""What the JIT did for a served bucket: its explain bundle from the store, as JSON, a report page, IR and
traces, and a profile made on demand in a child process (one at a time, bounded in time, below serving)."""

from __future__ import annotations

import json
import logging
import re
import threading
from pathlib import Path

from compiler.building.build import profile_kernel
from compiler.errors import BadRequestError, ConflictError, JitServeError, NotFoundError
from compiler.explaining.explain_profile import TRACE_DIR
from compiler.explaining.explain_report import REPORT_FILE, read_bundle, render_html
from compiler.storage.store import EXPLAIN_DIR, KernelStore

from ..models.registry import ServedModel
from ..models.state import ServedBucket

ENGINES = ("tvm", "onnxruntime")

log = logging.getLogger("jitserve")


def _server_links(report: dict):
    """Hrefs relative to the page at ``.../buckets/{bucket}/explain.html``."""

    def link(kind: str, name: str) -> str:
        if kind == "kernel_ir":
            return f"explain/ir/{list(report['ir'])[-1]}?kernel={name}"
        if kind == "trace":
            return f"explain/trace?engine={name}"
        return f"explain/{kind}/{name}"

    return link


def function_text(text: str, name: str) -> str | None:
    """One function of a printed IRModule: its decorators, its ``def`` and its body (the lines indented
    deeper than the ``def``)."""
    lines = text.splitlines()
    head = next((i for i, line in enumerate(lines) if re.match(rf"\s*def {re.escape(name)}\(", line)), None)
    if head is None:
        return None
    indent = len(lines[head]) - len(lines[head].lstrip())
    start = head
    while start > 0 and lines[start - 1].lstrip().startswith("@"):
        start -= 1
    end = head + 1
    while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent):
        end += 1
    return "\n".join(lines[start:end]) + "\n"


class Explanations:
    def __init__(self, artifacts: KernelStore, profile_seconds: float, threads: int | None) -> None:
        self.artifacts = artifacts
        self.profile_seconds = profile_seconds
        self.threads = threads
        self._profiling = threading.Lock()

    # -- the bundle ------------------------------------------------------

    @staticmethod
    def _bucket(served: ServedModel, label: str) -> ServedBucket:
        bucket = served.buckets.get(label)
        if bucket is None:
            known = ", ".join(sorted(served.buckets)) or "none yet"
            raise NotFoundError(f"model {served.name!r} has no bucket {label!r} (its buckets: {known})")
        return bucket

    def _key(self, bucket: ServedBucket) -> str:
        return bucket.serves_kernel_key or bucket.key

    def _directory(self, served: ServedModel, label: str) -> tuple[ServedBucket, Path]:
        bucket = self._bucket(served, label)
        directory = self.artifacts.library_path(self._key(bucket)).parent / EXPLAIN_DIR
        if not (directory / REPORT_FILE).is_file():
            raise NotFoundError(
                f"bucket {label!r} of model {served.name!r} has no explain bundle: its kernel is not compiled "
                f"yet (state {bucket.state.value}), or was compiled with JITSERVE_EXPLAIN_BUNDLES=false"
            )
        return bucket, directory

    def index(self, served: ServedModel, label: str) -> dict:
        """The bundle's index and profile, and the bucket's compile history (newest first)."""
        bucket, directory = self._directory(served, label)
        report, profile = read_bundle(directory)
        described = bucket.describe()
        return {
            "model": served.name,
            "version": served.record.version,
            "bucket": label,
            "kernel": self._key(bucket),
            "state": bucket.state.value,
            "engine": described["engine"],
            "latency_ms": described["latency_ms"],
            "openvino": described["openvino"],
            "explain": report,
            "profile": profile,
            "history": [event.model_dump(mode="json") for event in reversed(bucket.history)],
        }

    def html(self, served: ServedModel, label: str) -> str:
        bucket, directory = self._directory(served, label)
        report, profile = read_bundle(directory)
        axes = [{"name": axis, "policy": _axis_text(facts)} for axis, facts in served.describe()["axes"].items()]
        extra = {
            "title": f"{served.name} v{served.record.version}: {label}, served by {bucket.describe()['engine']}",
            "axes": axes,
            "history": [event.model_dump(mode="json") for event in reversed(bucket.history)],
        }
        return render_html(report, profile, links=_server_links(report), extra=extra)

    def ir(self, served: ServedModel, label: str, stage: str, kernel: str | None = None) -> str:
        _, directory = self._directory(served, label)
        report = json.loads((directory / REPORT_FILE).read_text())
        files = {**report["ir"], **report.get("code", {})}
        if stage not in files:
            raise NotFoundError(f"no stage {stage!r} in the bundle (stages: {', '.join(files)})")
        text = (directory / files[stage]["file"]).read_text()
        if kernel is None:
            return text
        found = function_text(text, kernel)
        if found is None:
            raise NotFoundError(f"no function {kernel!r} in stage {stage!r}")
        return found

    def trace(self, served: ServedModel, label: str, engine: str) -> dict:
        if engine not in ENGINES:
            raise BadRequestError(f"engine must be one of {', '.join(ENGINES)}, not {engine!r}")
        _, directory = self._directory(served, label)
        path = directory / TRACE_DIR / f"{engine}.json"
        if not path.is_file():
            raise NotFoundError(f"bucket {label!r} has no profile yet: POST .../explain/profile makes one")
        return json.loads(path.read_text())

    # -- profiling -------------------------------------------------------

    def profile(self, served: ServedModel, label: str, *, runs: int = 10) -> dict:
        """Time the bucket's kernel and ONNX Runtime's nodes in a child; one profile at a time."""
        bucket, _ = self._directory(served, label)
        manifest = self.artifacts.get(self._key(bucket))
        if manifest is None:
            raise NotFoundError(f"the kernel of bucket {label!r} is no longer stored")
        shapes = {name: [d if isinstance(d, int) else _largest(bucket, name, d) for d in dims]
                  for name, dims in manifest.bucket.items()}  # fmt: skip
        if not self._profiling.acquire(blocking=False):
            raise ConflictError("a profile is running: one at a time, try again when it ends")
        try:
            return profile_kernel(served.model, manifest, self.artifacts, shapes, served.options, runs=runs,
                                  threads=self.threads, timeout=self.profile_seconds)  # fmt: skip
        finally:
            self._profiling.release()

    def tuning_profile(self, served: ServedModel, bucket: ServedBucket) -> dict | None:
        """The profile that ranks a bucket's tuning tasks: its bundle's, or one made now; None where the
        bucket has no bundle or a profile cannot be made (its tasks are then ranked by their time alone)."""
        try:
            _, directory = self._directory(served, bucket.label)
            _, profile = read_bundle(directory)
            return profile or self.profile(served, bucket.label)
        except JitServeError as exc:
            log.info("tuning %s %s without a profile: %s", served.name, bucket.label, exc)
            return None


def _axis_text(facts: dict) -> str:
    """``pow2 1..8 (served as pow2); padding safe: outputs match after padding 2 -> 4``."""
    policy, safety = facts["policy"], facts.get("padding_safety") or {}
    bounds = f" {policy['min']}..{policy['max']}" if policy.get("min") is not None else ""
    verdict = ("padding safe: " if safety.get("safe") else "padding unsafe: ") + str(safety.get("reason", ""))
    return f"{policy['kind']}{bounds} (served as {facts['effective_policy']}); {verdict if safety else 'not probed'}"


def _largest(bucket: ServedBucket, name: str, dim: str) -> int:
    """A symbolic dim is profiled at the largest size its kernel was verified at."""
    sizes = (bucket.verify_sizes or {}).get(dim)
    if not sizes:
        raise BadRequestError(f"bucket {bucket.label!r} has a symbolic dim {dim!r} with no verified size")
    return max(sizes)
