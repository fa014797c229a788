"""The generation loop over a real decoder with a key/value cache (ONNX Runtime): greedy answers equal to a
loop that recomputes the whole sequence each step without a cache, sequences of different lengths decoded as
one batch, the cache reserved and returned in blocks, cancellation and bad input."""

from __future__ import annotations

import time

import numpy as np
import pytest

from compiler.errors import BadRequestError
from compiler.models.decoder import recognize_decoder
from compiler.models.model import load_model
from compiler.running.engines import OrtEngine
from server.runtime.generation.batch import GroupedBatches
from server.runtime.generation.generator import DONE, TOKEN, Generator, prefill
from server.runtime.generation.kv_blocks import CacheFullError, KvBlocks
from server.runtime.generation.sampling import SamplingParameters
from server.runtime.memory.memory_guard import MemoryGuard
from server.runtime.observability.metrics import Metrics
from tests.integration.serverproc import metric_value
from tests.synthetic import bert_encoder_model, kv_cache_decoder_model

DECODER = kv_cache_decoder_model()


@pytest.fixture(scope="module")
def spec():
    model = load_model(DECODER, max_bytes=1 << 26)
    return recognize_decoder(model.signature, model.index_bounds)


@pytest.fixture(scope="module")
def engine():
    return OrtEngine(DECODER)


def uncached_greedy(engine, spec, prompt: list[int], count: int) -> list[int]:
    """The plain loop: the whole sequence run again at every step, with an empty cache."""
    tokens = list(prompt)
    empty = np.zeros((1, spec.heads, 0, spec.head_dim), np.float32)
    for _ in range(count):
        n = len(tokens)
        feeds = {"input_ids": np.array([tokens])}
        if spec.batches_by_mask:
            feeds.update({"attention_mask": np.ones((1, n), np.int64), "position_ids": np.arange(n)[None]})
        feeds.update({name: empty for pair in spec.past for name in pair})
        logits = engine.run(feeds)["logits"]
        tokens.append(int(np.argmax(logits[0, -1])))
    return tokens[len(prompt) :]


def make_generator(spec, engine, *, blocks: int = 64, max_batch: int = 8, metrics: Metrics | None = None, **kw):
    pool = KvBlocks(blocks, 16, spec.cache_bytes_per_position())
    metrics = metrics or Metrics()
    generator = Generator("decoder", spec, engine, pool, metrics.generation, max_batch=max_batch,
                          max_waiting=16, max_tokens=128, **kw)  # fmt: skip
    return generator, metrics


def drain(sequence, timeout: float = 60.0) -> tuple[list[int], str]:
    tokens = []
    deadline = time.monotonic() + timeout
    while True:
        kind, value = sequence.events.get(timeout=max(deadline - time.monotonic(), 0.01))
        if kind == TOKEN:
            tokens.append(value)
        else:
            assert kind == DONE, value
            return tokens, value


def test_the_decoder_is_recognised_from_its_signature(spec):
    assert spec.layers == 2 and spec.heads == 4 and spec.head_dim == 16 and spec.vocab == 97
    assert spec.past[1] == ("past_key_values.1.key", "past_key_values.1.value")
    assert spec.present[1] == ("present.1.key", "present.1.value")
    assert spec.max_positions == 64  # the position table's rows, from the position_ids' gather
    assert spec.batches_by_mask
    assert spec.cache_bytes_per_position() == 2 * 2 * 4 * 16 * 4
    encoder = load_model(bert_encoder_model(layers=1), max_bytes=1 << 26)
    assert recognize_decoder(encoder.signature, encoder.index_bounds) is None


def test_greedy_tokens_equal_the_uncached_loop(spec, engine):
    generator, metrics = make_generator(spec, engine)
    try:
        prompt = [3, 14, 15, 92, 65, 35]
        tokens, reason = drain(generator.submit(prompt, SamplingParameters(max_tokens=20)))
        assert reason == "length" and tokens == uncached_greedy(engine, spec, prompt, 20)
        assert generator.blocks.used == 0
        text = metrics.exposition().decode()
        assert metric_value(text, "jitserve_generated_tokens_total", model="decoder") == 20
    finally:
        generator.close()


def test_sequences_of_different_lengths_decode_as_one_batch(spec, engine):
    """Four sequences submitted together (prompts of 1 to 9 tokens, 6 to 18 new tokens) join one batch; each
    answers what it answers alone, and the batch shrinks as they end."""
    generator, metrics = make_generator(spec, engine)
    try:
        requests = [([5], 18), ([7, 8, 9, 10], 12), ([1, 2, 3, 4, 5, 6, 7, 8, 9], 6), ([42, 42], 15)]
        sequences = [generator.submit(p, SamplingParameters(max_tokens=n)) for p, n in requests]
        for (prompt, count), sequence in zip(requests, sequences, strict=True):
            tokens, _ = drain(sequence)
            assert tokens == uncached_greedy(engine, spec, prompt, count), prompt
        text = metrics.exposition().decode()
        steps = metric_value(text, "jitserve_generate_step_batch_size_count", model="decoder")
        batched = metric_value(text, "jitserve_generate_step_batch_size_sum", model="decoder")
        assert batched / steps > 1.5, (batched, steps)  # the steps decoded several sequences at once
        assert generator.blocks.used == 0 and generator.describe()["cache_bytes_held"] == 0
    finally:
        generator.close()


def test_sequences_of_far_apart_lengths_are_batched_apart_and_the_cache_holds_their_positions(spec, engine):
    """A 60-position cache beside 1- and 3-position ones: one padded batch would hold 3 x 60 positions for 64
    live ones. The short two share a batch and the long one has its own: the cache holds its positions and at
    most a fifth more (and a block a row), and every row still answers as its own loop does."""
    caches, groups = {}, GroupedBatches(spec, block_positions=2)
    for name, prompt in (("long", list(range(1, 61))), ("short", [5]), ("shorter", [6, 7, 8])):
        logits, cache = prefill(spec, engine.run, prompt)
        caches[name] = (prompt, int(np.argmax(logits)))
        groups.join(name, cache)
    assert [group.sequences for group in groups.groups] == [["long"], ["short", "shorter"]]
    live = 60 + 1 + 3
    assert groups.padded_bytes() <= (1.2 * live + 2 * 3) * spec.cache_bytes_per_position()
    rows = groups.step(engine.run, [caches[name][1] for name in groups.sequences])
    for name, logits in zip(groups.sequences, rows, strict=True):
        prompt, first = caches[name]
        assert int(np.argmax(logits)) == uncached_greedy(engine, spec, prompt, 2)[1], name
        assert first == uncached_greedy(engine, spec, prompt, 1)[0]
    groups.leave(["long"])
    assert [group.sequences for group in groups.groups] == [["short", "shorter"]]


def test_a_decoder_without_a_mask_decodes_each_sequence_by_itself():
    """No attention_mask or position_ids: no padded cache can be masked, so each running sequence is its own
    call within the step, and still answers what the plain loop answers."""
    data = kv_cache_decoder_model(masked=False)
    model = load_model(data, max_bytes=1 << 26)
    spec = recognize_decoder(model.signature, model.index_bounds)
    assert spec.mask is None and spec.positions is None and not spec.batches_by_mask
    engine = OrtEngine(data)
    generator, metrics = make_generator(spec, engine)
    try:
        requests = [([5, 6], 9), ([7, 8, 9, 10, 11], 4)]
        sequences = [generator.submit(p, SamplingParameters(max_tokens=n)) for p, n in requests]
        for (prompt, count), sequence in zip(requests, sequences, strict=True):
            assert drain(sequence)[0] == uncached_greedy(engine, spec, prompt, count), prompt
        text = metrics.exposition().decode()
        assert metric_value(text, "jitserve_generate_step_batch_size_bucket", model="decoder", le="1.0") == (
            metric_value(text, "jitserve_generate_step_batch_size_count", model="decoder")
        )
    finally:
        generator.close()


def test_a_cache_that_cannot_fit_is_refused_with_the_reason_and_returned_when_sequences_end(spec, engine):
    generator, _ = make_generator(spec, engine, blocks=3)  # 48 positions
    try:
        first = generator.submit([1, 2, 3], SamplingParameters(max_tokens=29))  # 32 positions: 2 blocks
        with pytest.raises(CacheFullError, match=r"1 of 3 blocks free .* needs 2 for 32 positions"):
            generator.submit([1, 2, 3], SamplingParameters(max_tokens=29))
        assert CacheFullError.http_status == 503
        drain(first)
        assert generator.blocks.used == 0
        drain(generator.submit([1, 2, 3], SamplingParameters(max_tokens=29)))  # fits again
    finally:
        generator.close()


def test_a_cache_past_the_servers_memory_is_refused_by_memory_aware_admission(spec, engine):
    """The server's memory guard, at a limit this process is already past: the blocks are free, but a
    sequence that would fill them is refused with 503 and the guard's reason, and gives them back."""
    metrics = Metrics()
    guard = MemoryGuard(64 * 2**20, metrics, lambda: 0)
    generator, _ = make_generator(spec, engine, metrics=metrics, check_room=guard.check_room)
    try:
        with pytest.raises(CacheFullError, match="no room for a sequence's key/value cache: it needs about 0 MiB"):
            generator.submit([1, 2, 3], SamplingParameters(max_tokens=8))
        assert generator.blocks.used == 0
        assert metric_value(metrics.exposition().decode(), "jitserve_uploads_refused_for_memory_total") == 1
    finally:
        generator.close()


def test_a_cancelled_sequence_leaves_the_batch_and_frees_its_cache(spec, engine):
    generator, _ = make_generator(spec, engine)
    try:
        long = generator.submit([1, 2], SamplingParameters(max_tokens=60))
        other = generator.submit([3, 4], SamplingParameters(max_tokens=10))
        kind, _ = long.events.get(timeout=30)
        assert kind == TOKEN
        long.cancel()
        while (event := long.events.get(timeout=30))[0] == TOKEN:
            pass
        assert event == (DONE, "cancelled") and len(long.tokens) < 60
        assert drain(other)[0] == uncached_greedy(engine, spec, [3, 4], 10)  # the other went on, unharmed
        assert generator.blocks.used == 0
    finally:
        generator.close()


@pytest.mark.parametrize(
    ("prompt", "parameters", "message"),
    [
        (list(range(65)), {}, "input_ids: 65 prompt tokens are past the model's 64 positions"),
        ([1, 2], {"max_tokens": 129}, "max_tokens: 129 is past this server's limit 128"),
        ([1, 2, 3], {"max_tokens": 63}, "max_tokens: 63 new tokens after a 3-token prompt pass the model's 64"),
        ([1, 97], {}, r"input_ids: token id 97 is not in the vocabulary \[0, 96\]"),
        ([-1], {}, "input_ids: token id -1"),
        ([], {}, "input_ids: the prompt holds no token"),
        ([1], {"stop": [500]}, "stop: token id 500"),
    ],
)
def test_bad_input_is_refused_naming_the_field(spec, engine, prompt, parameters, message):
    generator, _ = make_generator(spec, engine)
    try:
        with pytest.raises(BadRequestError, match=message):
            generator.submit(prompt, SamplingParameters(**parameters))
        assert generator.blocks.used == 0
    finally:
        generator.close()


def test_sampling_is_repeatable_by_seed_and_stops_at_a_stop_token(spec, engine):
    generator, _ = make_generator(spec, engine)
    try:
        sampled = SamplingParameters(max_tokens=16, temperature=1.5, top_k=20, top_p=0.9, seed=7)
        first, again = (drain(generator.submit([9, 9], sampled))[0] for _ in range(2))
        assert first == again and first != uncached_greedy(engine, spec, [9, 9], 16)
        greedy = uncached_greedy(engine, spec, [9, 9], 16)
        stop = greedy[5]
        tokens, reason = drain(generator.submit([9, 9], SamplingParameters(max_tokens=16, stop=[stop])))
        assert reason == "stop" and tokens == greedy[: greedy.index(stop) + 1]
    finally:
        generator.close()


def test_a_decoders_session_gets_the_generation_threads_spinning_only_within_a_call():
    """The generation loop calls a decoder's session step after step from one thread: it gets
    ``generate_ort_threads`` spinning while a call lasts (force_spinning_stop), where another model's session
    keeps ``ort_threads`` without spinning."""
    from server.runtime.models.model_checks import open_onnxruntime
    from server.settings import Settings

    settings = Settings(ort_threads=1, generate_ort_threads=2, ort_spinning=False)
    decoder = open_onnxruntime(settings, load_model(kv_cache_decoder_model(), max_bytes=1 << 30), {"kind": "llvm"})
    encoder = open_onnxruntime(settings, load_model(bert_encoder_model(), max_bytes=1 << 30), {"kind": "llvm"})
    decoder_options, encoder_options = decoder.session.get_session_options(), encoder.session.get_session_options()

    def entry(options, key: str) -> str | None:
        try:
            return options.get_session_config_entry(key)
        except RuntimeError:  # not set: ONNX Runtime's default
            return None

    assert decoder_options.intra_op_num_threads == 2
    assert entry(decoder_options, "session.force_spinning_stop") == "1"
    assert entry(decoder_options, "session.intra_op.allow_spinning") in (None, "1")
    assert encoder_options.intra_op_num_threads == 1
    assert entry(encoder_options, "session.intra_op.allow_spinning") == "0"
    assert entry(encoder_options, "session.force_spinning_stop") is None
