"""One decoder model's generation loop: sequences submitted from any thread, decoded by one thread, step by
step. At every step the waiting sequences' prompts are prefilled (each its own call) and join the running
batch; the running sequences are decoded together as one call, their caches padded to the longest and the
padding masked (where the model takes ``attention_mask`` and ``position_ids``; one call each otherwise);
finished and cancelled sequences leave. The cache of each sequence is held here between its steps: the
``present`` tensors of its last step, handed back as the next step's ``past`` (:mod:`.batch`).

The engine is ONNX Runtime (the floor every model is served by at once); it returns each step's ``present``
as a new tensor (the past with one position appended), so a step copies the cache once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from compiler.errors import BadRequestError, InsufficientMemoryError, UnavailableError
from compiler.models.decoder import DecoderSpec
from compiler.running.engines import OrtEngine

from ..observability.metrics.generation import GenerationMetrics
from .batch import GroupedBatches, SeparateSequences, present_cache
from .kv_blocks import CacheFullError, KvBlocks
from .sampling import SamplingParameters, next_token
from .text import Text

log = logging.getLogger("jitserve")

DONE = "done"
TOKEN = "token"
ERROR = "error"


@dataclass(eq=False)
class Sequence:
    """One generate request: its prompt, what it generated, and its cache between steps. Its events (a token,
    the end and why) are read by the request's thread from ``events``."""

    prompt: list[int]
    parameters: SamplingParameters
    blocks: int
    arrived: float = field(default_factory=time.perf_counter)
    tokens: list[int] = field(default_factory=list)
    events: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    finish_reason: str | None = None
    last_token_at: float = 0.0
    rng: np.random.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.parameters.seed)

    @property
    def length(self) -> int:
        """Positions in its cache."""
        return len(self.prompt) + len(self.tokens) - (1 if self.tokens else 0)

    def cancel(self) -> None:
        """The client went away: the sequence leaves the batch at the next step and frees its cache."""
        self.cancelled.set()


class Generator:
    """The generation loop of one decoder model over ``engine`` (the model's ONNX Runtime engine: its weights
    held once, for generate and predict alike)."""

    def __init__(
        self,
        model: str,
        spec: DecoderSpec,
        engine: OrtEngine,
        blocks: KvBlocks,
        metrics: GenerationMetrics,
        *,
        max_batch: int,
        max_waiting: int,
        max_tokens: int,
        text: Text | None = None,
        check_room: Callable[[str, int], None] = lambda _what, _nbytes: None,
    ) -> None:
        self.model = model
        self.spec = spec
        self.engine = engine
        self.blocks = blocks
        self.metrics = metrics
        self.max_batch = max_batch
        self.max_waiting = max_waiting
        self.max_tokens = max_tokens
        self.text = text
        self._check_room = check_room
        """The server's memory-aware admission (:meth:`..memory.memory_guard.MemoryGuard.check_room`)."""
        """The model's tokenizer where it was uploaded with one: generate then takes and gives text."""
        self._waiting: list[Sequence] = []
        self._running = (
            GroupedBatches(spec, blocks.block_positions) if spec.batches_by_mask else SeparateSequences(spec)
        )
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"generate-{model}", daemon=True)
        self._thread.start()

    # -- requests ------------------------------------------------------------

    def check(self, prompt: list[int], parameters: SamplingParameters) -> None:
        """400 naming the field for a prompt or limit the model cannot take."""
        spec = self.spec
        if not prompt:
            raise BadRequestError("input_ids: the prompt holds no token")
        bad = [token for token in prompt if not 0 <= token < spec.vocab]
        if bad:
            raise BadRequestError(f"input_ids: token id {bad[0]} is not in the vocabulary [0, {spec.vocab - 1}]")
        if parameters.max_tokens > self.max_tokens:
            raise BadRequestError(f"max_tokens: {parameters.max_tokens} is past this server's limit {self.max_tokens}")
        bad_stop = [token for token in parameters.stop if not 0 <= token < spec.vocab]
        if bad_stop:
            raise BadRequestError(f"stop: token id {bad_stop[0]} is not in the vocabulary [0, {spec.vocab - 1}]")
        limit = spec.max_positions
        if limit is not None and len(prompt) > limit:
            raise BadRequestError(f"input_ids: {len(prompt)} prompt tokens are past the model's {limit} positions")
        if limit is not None and len(prompt) + parameters.max_tokens - 1 > limit:
            room = limit - len(prompt) + 1
            raise BadRequestError(
                f"max_tokens: {parameters.max_tokens} new tokens after a {len(prompt)}-token prompt pass the "
                f"model's {limit} positions (at most {room})"
            )

    def prompt_ids(self, input_ids: list[int] | None, text_input: str | None) -> list[int]:
        """The prompt's token ids, given as ids or as text (where the model has a tokenizer); 400 otherwise."""
        if (input_ids is None) == (text_input is None):
            raise BadRequestError("give the prompt as one of input_ids and text_input")
        if text_input is None:
            return input_ids
        if self.text is None:
            raise BadRequestError(
                f"text_input: model {self.model!r} was uploaded without a tokenizer.json; give input_ids"
            )
        return self.text.encode(text_input)

    def submit(self, prompt: list[int], parameters: SamplingParameters) -> Sequence:
        """A checked sequence with its cache blocks reserved, waiting to join the batch; 503 where the cache or
        the waiting queue is full."""
        self.check(prompt, parameters)
        positions = len(prompt) + parameters.max_tokens
        try:  # the blocks it may fill must fit in the server's memory beside what it holds (outside the lock)
            self._check_room(
                "a sequence's key/value cache", self.blocks.blocks_for(positions) * self.blocks.block_bytes
            )
        except InsufficientMemoryError as exc:
            raise CacheFullError(str(exc)) from None
        with self._wake:
            if self._closed:
                raise UnavailableError(f"model {self.model!r} is no longer served")
            if len(self._waiting) >= self.max_waiting:
                raise UnavailableError(f"{len(self._waiting)} sequences already wait to join the batch; retry later")
            sequence = Sequence(prompt, parameters, self.blocks.reserve(positions))
            self._waiting.append(sequence)
            self._publish()
            self._wake.notify()
        return sequence

    def close(self) -> None:
        """Stop the loop; sequences still waiting or running end with an error event."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=30)

    def describe(self) -> dict:
        with self._wake:
            running, waiting = len(self._running), len(self._waiting)
        return {
            "decoder": self.spec.describe(),
            "tokenizer": self.text is not None,
            "running": running,
            "waiting": waiting,
            "cache_blocks": {"used": self.blocks.used, "total": self.blocks.total,
                             "positions_per_block": self.blocks.block_positions},
            "cache_bytes_held": self._running.padded_bytes(),
        }  # fmt: skip

    # -- the loop --------------------------------------------------------------

    def _publish(self) -> None:
        self.metrics.set_state(
            model=self.model, running=len(self._running), waiting=len(self._waiting), cache_blocks=self.blocks.used
        )

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._closed and not self._waiting and not self._running:
                    self._wake.wait()
                if self._closed:
                    break
                room = self.max_batch - len(self._running)
                joining, self._waiting = self._waiting[:room], self._waiting[room:]
            try:
                self._step(joining)
            except Exception as exc:
                log.exception("generation step of %s failed", self.model)
                for sequence in [*joining, *self._running.sequences]:
                    self._end(sequence, ERROR, f"{type(exc).__name__}: {exc}")
                self._running.leave(list(self._running.sequences))
        for sequence in [*self._waiting, *self._running.sequences]:
            self._end(sequence, ERROR, "the model stopped serving")
        self._running.leave(list(self._running.sequences))
        self._waiting = []
        self._publish()

    def _step(self, joining: list[Sequence]) -> None:
        running = self._running
        for sequence in joining:  # prefill: the prompt whole, alone; its first token
            if sequence.cancelled.is_set():
                self._end(sequence, "cancelled")
                continue
            logits, cache = prefill(self.spec, self.engine.run, sequence.prompt)
            now = time.perf_counter()
            self.metrics.record_first_token(model=self.model, seconds=now - sequence.arrived)
            if self._emit(sequence, logits, now):
                running.join(sequence, cache)
        cancelled = [s for s in running.sequences if s.cancelled.is_set()]
        for sequence in cancelled:
            self._end(sequence, "cancelled")
        running.leave(cancelled)
        if running.sequences:
            group = list(running.sequences)
            rows = running.step(self.engine.run, [s.tokens[-1] for s in group])
            now = time.perf_counter()
            batch = len(group) if self.spec.batches_by_mask else 1
            self.metrics.record_step(model=self.model, batch=batch, gaps=[now - s.last_token_at for s in group])
            running.leave([s for s, logits in zip(group, rows, strict=True) if not self._emit(s, logits, now)])
        with self._wake:
            self._publish()

    def _emit(self, sequence: Sequence, logits: np.ndarray, now: float) -> bool:
        """Choose and send its next token; whether it goes on."""
        token = next_token(logits, sequence.parameters, sequence.rng)
        sequence.tokens.append(token)
        sequence.last_token_at = now
        sequence.events.put((TOKEN, token))
        limit = self.spec.max_positions
        if token in sequence.parameters.stop:
            self._end(sequence, "stop")
        elif len(sequence.tokens) >= sequence.parameters.max_tokens or (limit and sequence.length >= limit):
            self._end(sequence, "length")
        return sequence.finish_reason is None

    def _end(self, sequence: Sequence, reason: str, detail: str | None = None) -> None:
        if sequence.finish_reason is not None:
            return
        sequence.finish_reason = reason if reason != ERROR else "error"
        self.blocks.release(sequence.blocks)
        self.metrics.record_end(model=self.model, finish_reason=sequence.finish_reason)
        sequence.events.put((ERROR, detail) if reason == ERROR else (DONE, reason))


def prefill(spec: DecoderSpec, run, prompt: list[int]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The prompt run whole by ``run`` (the model's call) against an empty cache: its last position's logits,
    and its cache."""
    count = len(prompt)
    feeds = {spec.tokens: np.array([prompt], dtype=np.int64)}
    if spec.mask:
        feeds[spec.mask] = np.ones((1, count), np.int64)
    if spec.positions:
        feeds[spec.positions] = np.arange(count, dtype=np.int64)[None]
    empty = np.zeros((1, spec.heads, 0, spec.head_dim), dtype=spec.cache_dtype)
    for pair in spec.past:
        feeds.update(dict.fromkeys(pair, empty))
    outputs = run(feeds)
    return outputs[spec.logits][0, -1], present_cache(spec, outputs)
