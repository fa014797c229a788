"""The generation loops of the served decoder models: one :class:`.generator.Generator` per model version,
started at its first generate request, closed when that version stops being served."""

from __future__ import annotations

import threading
from collections.abc import Callable

from compiler.errors import BadRequestError
from compiler.models.decoder import recognize_decoder

from ...settings import Settings
from ..models.registry import ServedModel
from ..observability.metrics import Metrics
from .generator import Generator
from .kv_blocks import KvBlocks
from .text import Text


def decoder_refusal(served: ServedModel) -> str:
    return (
        f"model {served.name!r} is not a decoder with a key/value cache: generate needs input_ids, "
        "past_key_values.{i}.key/.value inputs and present.{i}.key/.value outputs"
    )


class Generation:
    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        tokenizer_of: Callable[[ServedModel], bytes | None],
        check_room: Callable[[str, int], None],
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self._check_room = check_room
        """Memory-aware admission: a sequence's cache blocks must fit beside what the server holds."""
        self._tokenizer_of = tokenizer_of
        """The ``tokenizer.json`` stored with a model version, or None."""
        self._generators: dict[str, tuple[ServedModel, Generator]] = {}
        self._lock = threading.Lock()

    def generator(self, served: ServedModel) -> Generator:
        """The model version's loop, started now where it has none; 400 for a model that is no decoder."""
        with self._lock:
            found = self._generators.get(served.name)
            if found is not None and found[0] is served:
                return found[1]
            spec = recognize_decoder(served.model.signature, served.model.index_bounds)
            if spec is None:
                raise BadRequestError(decoder_refusal(served))
            if found is not None:  # an older version's loop
                found[1].close()
            s = self.settings
            per_block = s.generate_block_positions * spec.cache_bytes_per_position()
            blocks = KvBlocks(s.generate_cache_bytes // per_block, s.generate_block_positions,
                              spec.cache_bytes_per_position())  # fmt: skip
            tokenizer = self._tokenizer_of(served)
            generator = Generator(
                served.name, spec, served.ort, blocks, self.metrics.generation,
                max_batch=s.generate_max_batch, max_waiting=s.generate_max_waiting, max_tokens=s.generate_max_tokens,
                text=Text(tokenizer) if tokenizer is not None else None, check_room=self._check_room,
            )  # fmt: skip
            self._generators[served.name] = (served, generator)
            return generator

    def describe(self, served: ServedModel) -> dict | None:
        """The model's generation state where its loop runs; its decoder where it is one; else None."""
        found = self._generators.get(served.name)
        if found is not None and found[0] is served:
            return found[1].describe()
        spec = recognize_decoder(served.model.signature, served.model.index_bounds)
        return None if spec is None else {"decoder": spec.describe(), "running": 0, "waiting": 0}

    def retire(self, served: ServedModel) -> None:
        with self._lock:
            found = self._generators.get(served.name)
            if found is not None and found[0] is served:
                del self._generators[served.name]
                found[1].close()

    def close(self) -> None:
        with self._lock:
            generators, self._generators = list(self._generators.values()), {}
        for _, generator in generators:
            generator.close()
