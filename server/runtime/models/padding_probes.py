"""Padding probes in the background: an upload answers once its model is stored and ONNX Runtime serves
it; the probe (:func:`compiler.shapes.padding.probe_padding`) judges its axes afterwards, in a thread of its
own, at most ``PROBES_AT_ONCE`` at a time over the server.

Until the probe ends, the axes it judges have no verdict, and the planner pads no axis without one: every
request is served by ONNX Runtime at its exact shape, and no bucket of the model is compiled (compile
admission defers them: buckets planned without verdicts are abandoned once padding is allowed). When it
ends, ``settle`` puts the verdicts in force (planner, record, warm buckets, batching). A probe that fails
leaves its axes unpaddable (exact buckets only); one whose version was retired meanwhile is dropped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from compiler.models.memory import check_sizes_fit
from compiler.models.signature import Signature
from compiler.running.engines import ArenaReturningRuns
from compiler.shapes.buckets import AxisSafety
from compiler.shapes.padding import default_probe_sizes, probe_padding

from ...settings import Settings
from ..observability.metrics import Metrics
from .model_checks import compile_options
from .records import ModelConfig
from .registry import PaddingProbe, ServedModel

log = logging.getLogger("jitserve")

PROBES_AT_ONCE = 2
"""Probes running at once: each runs the model on ONNX Runtime at real sizes, beside serving; two let a
small model's probe pass a large one's."""
SLOT_RECHECK_SECONDS = 0.25
"""How often a probe waiting for a slot looks whether it was cancelled."""

Settle = Callable[[ServedModel, dict[str, AxisSafety], bool], bool]
"""Put verdicts in force (``True``: made by a probe that ran to its end, stored as the current probe's);
False when the version is no longer the one served."""


class PaddingProbes:
    """Each served version's padding probe, in a thread of its own; ``close`` stops them all."""

    def __init__(self, settings: Settings, metrics: Metrics, database_dir: Path, *, settle: Settle) -> None:
        self.settings = settings
        self.metrics = metrics
        self.database_dir = database_dir
        self._settle = settle
        self._slots = threading.Semaphore(PROBES_AT_ONCE)
        self._lock = threading.Lock()
        self._active: set[PaddingProbe] = set()
        self._closing = False

    def start(self, served: ServedModel) -> None:
        """Probe the served version's unjudged axes in a thread of its own (it waits for a slot)."""
        status = served.padding_probe
        with self._lock:
            if self._closing:
                status.cancelled.set()
                status.end("cancelled")
                return
            self._active.add(status)
        thread = threading.Thread(target=self._run, args=(served,), name=f"jitserve-probe-{served.name}", daemon=True)
        thread.start()

    def close(self) -> None:
        """Shutdown: every probe stops before its next ONNX Runtime run; none starts any more."""
        with self._lock:
            self._closing = True
            for status in self._active:
                status.cancelled.set()

    def _run(self, served: ServedModel) -> None:
        status = served.padding_probe
        try:
            if not self._take_slot(status):
                status.end("cancelled")
                return
            try:
                self._probe_and_settle(served, status)
            finally:
                self._slots.release()
        finally:
            with self._lock:
                self._active.discard(status)

    def _take_slot(self, status: PaddingProbe) -> bool:
        while not self._slots.acquire(timeout=SLOT_RECHECK_SECONDS):
            if status.cancelled.is_set():
                return False
        if status.cancelled.is_set():
            self._slots.release()
            return False
        return True

    def _probe_and_settle(self, served: ServedModel, status: PaddingProbe) -> None:
        name, version = served.name, served.record.version
        status.begin()
        error = None
        try:
            verdicts = self._judge(served, status.cancelled)
        except Exception as exc:  # noqa: BLE001 - whatever went wrong, the model stays served, unpadded
            if status.cancelled.is_set():
                log.info("model %s v%d: padding probe stopped (retired or shutting down)", name, version)
                status.end("cancelled")
                return
            error = f"{type(exc).__name__}: {exc}"
            log.error("model %s v%d: the padding probe failed (%s); its axes are served exactly", name, version, error)
            verdicts = unprobed_verdicts(served, f"the padding probe failed ({error}); served exactly")
        try:
            settled = self._settle(served, verdicts, error is None)
        except Exception as exc:  # a probe thread must end, and say why (logged with its traceback)
            log.exception("model %s v%d: the padding probe's verdicts could not be put in force", name, version)
            status.end("failed", f"{type(exc).__name__}: {exc}")
            return
        if not settled:
            log.info("model %s v%d: padding verdicts dropped: the version is no longer served", name, version)
            status.end("cancelled")
            return
        outcome, seconds = "failed" if error else "done", status.seconds or 0.0
        self.metrics.correctness.record_padding_probe(model=name, outcome=outcome, seconds=seconds)
        log.info("model %s v%d: padding probe %s in %.2f s", name, version, outcome, seconds)
        status.end(outcome, error)  # last: whoever waits for it finds the verdicts in force and counted

    def _judge(self, served: ServedModel, cancelled: threading.Event) -> dict[str, AxisSafety]:
        """The verdicts of the axes the served version's policies leave to the probe."""
        model, config, settings = served.model, served.record.config, self.settings
        options = compile_options(settings, config, self.database_dir)
        check_sizes_fit(model.signature, config.probe_sizes, settings.max_tensor_bytes, "probe_sizes")
        verdicts = probe_padding(
            ArenaReturningRuns(served.ort),
            model.signature,
            {axis: config.policy_for(axis) for axis in model.signature.axes()},
            probe_sizes(model.signature, config),
            configured=set(config.probe_sizes),
            pad_values=config.pad_values,
            rtol=options.rtol,
            atol=options.atol,
            seed=options.seed,
            index_limits=model.index_bounds.limits,
            max_input_bytes=settings.max_tensor_bytes,
            seconds=settings.probe_seconds,
            cancelled=cancelled,
        )
        return {axis: verdict for axis, verdict in verdicts.items() if axis not in served.record.safety}


def unprobed_verdicts(served: ServedModel, reason: str) -> dict[str, AxisSafety]:
    """Every axis without a verdict, unsafe for want of knowing: served exactly."""
    judged = served.record.safety
    return {
        axis: AxisSafety(axis=axis, safe=False, reason=reason, probed=False)
        for axis in served.model.signature.axes()
        if axis not in judged
    }


def probe_sizes(signature: Signature, config: ModelConfig) -> dict[str, int]:
    """Starting sizes for every symbolic axis: the config's, else the first warm bucket's, else defaults."""
    known: dict[str, int] = {}
    if config.warm_buckets:
        for spec in signature.inputs:
            shape = config.warm_buckets[0].get(spec.name, [])
            for index, axis in spec.symbolic_axes():
                if index < len(shape) and shape[index] >= 1:
                    known[axis] = shape[index]
    known.update(config.probe_sizes)
    return default_probe_sizes(signature, known)
