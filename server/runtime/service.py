"""The runtime's front object: the parts :func:`.wiring.build_runtime` wired, and the few calls the
HTTP layer makes. Never imports FastAPI.

Requests are served at once: by the bucket's verified TVM kernel when it is
loaded, else by ONNX Runtime; a bucket whose traffic earns a compile
(compile admission) gets one in the background (single-flight, bounded
queue ordered by traffic, child processes below serving's priority).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from compiler.building.worker import stop_children
from compiler.errors import ConflictError, JitServeError
from compiler.models.model import load_model
from compiler.models.upload import load_upload_folder, upload_folder
from compiler.storage.store import KernelStore

from ..settings import Settings
from .compiling.builds import BucketBuilder
from .compiling.compile_admission import CompileAdmission
from .compiling.rerouter import Rerouter
from .compiling.router import Router
from .compiling.scheduler import CompileScheduler
from .compiling.tuner import BackgroundTuner
from .generation.generation import Generation
from .generation.generator import Sequence
from .generation.sampling import SamplingParameters
from .generation.text import Text
from .memory.allocator import return_memory_now_and_after
from .memory.kernel_cache import Kernels
from .models.model_admission import ModelAdmission
from .models.records import ModelStore
from .models.registry import Registry, ServedModel
from .models.store_janitor import StoreJanitor
from .models.store_watch import StoreWatch
from .observability.explain import Explanations
from .observability.metrics import Metrics
from .serving.bodies import JsonParsers
from .serving.inference import Inference, Prediction
from .serving.requests import Codec, RequestPath
from .serving.shadow import ShadowChecks

log = logging.getLogger("jitserve")


@dataclass(eq=False)
class ModelService:
    """The runtime's parts, wired by :func:`.wiring.build_runtime`, and the calls the HTTP layer makes."""

    settings: Settings
    metrics: Metrics
    models_store: ModelStore
    artifacts: KernelStore
    kernels: Kernels
    registry: Registry
    explanations: Explanations
    router: Router
    shadow: ShadowChecks
    builder: BucketBuilder
    scheduler: CompileScheduler
    compile_admission: CompileAdmission
    inference: Inference
    admission: ModelAdmission
    tuner: BackgroundTuner
    rerouter: Rerouter
    store_watch: StoreWatch
    store_janitor: StoreJanitor
    json_parsers: JsonParsers
    generation: Generation
    requests: RequestPath
    _startup_models: set[tuple[str, int]] = field(default_factory=set, init=False)
    """(name, version) of the models served at start, whose warm buckets gate readiness."""

    # -- lifecycle -------------------------------------------------------

    def start(self) -> None:
        self.scheduler.start()
        kernels_ok, removed = self.artifacts.check()
        for problem in removed:
            log.warning("store check: removed damaged kernel %s", problem)
        self.store_watch.remember()
        models_ok, models_skipped = self.admission.restore_stored()
        self._startup_models = {(served.name, served.record.version) for served in self.registry.all()}
        log.info(
            "store check: %d kernels ok, %d damaged removed; %d models served, %d skipped",
            kernels_ok, len(removed), models_ok, models_skipped,
        )  # fmt: skip
        self.metrics.kernels.set_store_check(store="kernels", ok=kernels_ok, damaged=len(removed))
        self.metrics.kernels.set_store_check(store="models", ok=models_ok, damaged=models_skipped)
        if self.jit_enabled and self.settings.tuning_enabled:
            self.tuner.start()
        if self.jit_enabled:
            self.rerouter.start()
        self.store_watch.start()
        if self.settings.kernel_store_bytes:
            self.store_janitor.start()

    def close(self) -> None:
        """Shutdown: models retired first (a compile killed now records nothing), then compile and
        tuning children killed, so their threads return at once."""
        self.admission.close()
        self.store_watch.stop()
        self.store_janitor.stop()
        self.tuner.stop()
        self.rerouter.stop()
        for served in self.registry.all():
            served.retire()
        stopped = stop_children()
        if stopped:
            log.info("shutdown: stopped %d compile or tuning children", stopped)
        self.scheduler.close()
        self.inference.close()
        self.shadow.close()
        self.json_parsers.close()
        self.generation.close()

    @property
    def jit_enabled(self) -> bool:
        return self.scheduler.enabled

    # -- models ----------------------------------------------------------

    @property
    def model_names(self) -> list[str]:
        return self.registry.names

    def get(self, name: str) -> ServedModel:
        return self.registry.get(name)

    def describe(self, name: str) -> dict:
        return self._describe(self.registry.get(name))

    def _describe(self, served: ServedModel) -> dict:
        generation = self.generation.describe(served)
        return served.describe() | {
            "compile_admission": self.compile_admission.describe(served),
            "weights": self.kernels.describe_weights(served),
            **({"generation": generation} if generation else {}),
        }

    def register(self, name: str, data: bytes, config: dict | None = None, *, replace: bool = False) -> dict:
        """Serve a self-contained model given as bytes."""
        load = partial(load_model, data, max_bytes=self.settings.max_model_bytes)
        return self._registered(self.admission.register(name, load, config, replace=replace))

    def _registered(self, served: ServedModel) -> dict:
        """An upload's answer; the copies its checks made (parsed protos, bytes) go back to the system as it
        is sent (collecting and trimming a heap that held a 415 MiB model took 0.3 s)."""
        return_memory_now_and_after((), now=False)
        return self._describe(served)

    def register_default(self, name: str, data: bytes, config: dict) -> None:
        """Serve a built-in model on an empty store. Replicas starting together on one store race for
        it: the ones that lose serve the winner's."""
        try:
            self.register(name, data, config)
        except ConflictError:
            self.admission.follow_store(name)
        served = self.registry.find(name)
        if served is not None:  # part of the start: its warm buckets gate readiness
            self._startup_models.add((served.name, served.record.version))

    def new_upload_folder(self) -> Path:
        """A private folder to receive one upload into; cleared at start if a crash leaves it behind."""
        return upload_folder(self.models_store.staging_area)

    def register_upload(self, name: str, folder: Path, config: dict | None = None, *, replace: bool = False) -> dict:
        """Serve the model an upload folder holds (with its external data, or as an archive)."""
        load = partial(load_upload_folder, folder, max_bytes=self.settings.max_model_bytes)
        return self._registered(self.admission.register(name, load, config, replace=replace))

    def delete(self, name: str) -> None:
        self.admission.delete(name)

    def repository_index(self) -> list[dict]:
        """Every stored model with whether it is served (the repository extension's index)."""
        return [
            {"name": name, "version": str(served.record.version), "state": "READY", "reason": ""}
            if (served := self.registry.find(name)) is not None
            else {"name": name, "state": "UNAVAILABLE", "reason": "unloaded"}
            for name in self.models_store.names()
        ]

    def load_stored(self, name: str) -> None:
        self.admission.load_stored(name)

    def unload(self, name: str) -> None:
        self.admission.unload(name)

    def ready(self) -> tuple[bool, list[str]]:
        """Ready once the warm buckets of the models served at start are ready or failed; the ones still
        waiting otherwise. Models uploaded later (here or on a peer) never take a running server out of
        service: ONNX Runtime answers them while their kernels compile."""
        if not self.jit_enabled:
            return True, []
        waiting = [
            label
            for served in self.registry.all()
            if (served.name, served.record.version) in self._startup_models
            for label in served.waiting_warm_buckets()
        ]
        return not waiting, waiting

    # -- predictions -----------------------------------------------------

    async def infer(self, codec: Codec) -> tuple[Any, Prediction]:
        """A protocol's request, whole: the one way a request enters the runtime (:mod:`.requests`)."""
        return await self.requests.infer(codec)

    def generate(
        self, name: str, input_ids: list[int] | None, text_input: str | None, parameters: SamplingParameters
    ) -> tuple[Sequence, Text | None]:
        """A generate request's sequence, joining its model's running batch (its events say how it goes), and
        the model's tokenizer where it has one."""
        generator = self.generation.generator(self.registry.get(name))
        return generator.submit(generator.prompt_ids(input_ids, text_input), parameters), generator.text

    def predict(self, name: str, inputs: Any) -> Prediction:
        """Prepare and run a request in the calling thread."""
        try:
            job = self.inference.prepare(self.registry.get(name), inputs)
        except JitServeError as exc:
            self.inference.reject(name, exc)
            raise
        return self.inference.execute(job)
