"""Generate against a real server on loopback: a decoder with a key/value cache uploaded as any model,
``/v2/models/{name}/generate`` answering what a plain greedy loop answers, the stream one event per token,
a stream whose client goes away freeing its cache, and bad input refused naming the field."""

from __future__ import annotations

import io
import json
import zipfile

import pytest

from compiler.models.decoder import recognize_decoder
from compiler.models.model import load_model
from compiler.running.engines import OrtEngine
from tests.integration.serverproc import ServerProcess, metric_value, wait_until
from tests.integration.test_serving import upload
from tests.server.runtime.test_generation import uncached_greedy
from tests.synthetic import kv_cache_decoder_model

DECODER = kv_cache_decoder_model()
CACHE_BYTES = 3 * 16 * 1024
"""Per model: 3 blocks of 16 positions of the decoder's 1 KiB (48 positions); 96 of the slow one's 32 bytes."""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = ServerProcess(tmp_path_factory.mktemp("generate") / "data", tuning_enabled=False,
                           generate_cache_bytes=CACHE_BYTES).start()  # fmt: skip
    try:
        with server.client() as client:
            assert upload(client, "gpt", DECODER).status_code == 201, server.log()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def reference():
    model = load_model(DECODER, max_bytes=1 << 26)
    spec = recognize_decoder(model.signature, model.index_bounds)
    return OrtEngine(DECODER), spec


def test_generate_answers_the_plain_greedy_loop_and_describes_the_decoder(server, reference):
    with server.client() as client:
        answer = client.post(
            "/v2/models/gpt/generate", json={"input_ids": [4, 8, 15, 16], "parameters": {"max_tokens": 12}}
        )
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["output_ids"] == uncached_greedy(*reference, [4, 8, 15, 16], 12)
        assert body["finish_reason"] == "length" and body["model_name"] == "gpt" and body["model_version"] == "1"
        generation = client.get("/models/gpt").json()["generation"]
        assert generation["decoder"]["layers"] == 2 and generation["decoder"]["max_positions"] == 64
        assert generation["cache_blocks"]["used"] == 0 and generation["running"] == 0
        text = client.get("/metrics").text
        assert metric_value(text, "jitserve_generated_tokens_total", model="gpt") >= 12
        assert metric_value(text, "jitserve_generate_time_to_first_token_seconds_count", model="gpt") >= 1


def test_the_stream_sends_one_event_per_token_then_why_it_ended(server, reference):
    with (
        server.client() as client,
        client.stream(
            "POST", "/v2/models/gpt/generate_stream", json={"input_ids": [1, 2, 3], "parameters": {"max_tokens": 9}}
        ) as response,
    ):
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[len("data: ") :]) for line in response.iter_lines() if line.startswith("data: ")]
    assert [e["index"] for e in events[:-1]] == list(range(9))
    assert [e["output_ids"][0] for e in events[:-1]] == uncached_greedy(*reference, [1, 2, 3], 9)
    assert events[-1]["finish_reason"] == "length" and events[-1]["output_ids"] == []


def test_a_client_that_goes_away_frees_its_sequence(server):
    """A decoder slow enough (100,000 logits a step, 1,000 steps) to be mid-sequence when its client leaves,
    with a cache of 32 bytes a position."""
    slow = kv_cache_decoder_model(layers=1, hidden=4, heads=1, vocab=100_000, positions=1100)
    with server.client() as client:
        assert upload(client, "slow", slow).status_code == 201
        with client.stream(
            "POST", "/v2/models/slow/generate_stream", json={"input_ids": [5], "parameters": {"max_tokens": 1000}}
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    break  # one token, then the connection closes
        wait_until(lambda: client.get("/models/slow").json()["generation"]["cache_blocks"]["used"] == 0,
                   timeout=30, what="the cancelled sequence's cache returned")  # fmt: skip
        text = client.get("/metrics").text
        assert metric_value(text, "jitserve_generate_sequences_total", model="slow", finish_reason="cancelled") == 1
        assert metric_value(text, "jitserve_generated_tokens_total", model="slow") < 1000


def test_no_length_costs_a_compile(server):
    """Prompts of 1 to 40 tokens, each grown to 48 positions (this server's cache): every step is served, and
    the model has no compile."""
    with server.client() as client:
        for length in (1, 7, 23, 40):
            body = {"input_ids": list(range(1, length + 1)), "parameters": {"max_tokens": 48 - length}}
            answer = client.post("/v2/models/gpt/generate", json=body)
            assert answer.status_code == 200, answer.text
            assert len(answer.json()["output_ids"]) == 48 - length
        assert metric_value(client.get("/metrics").text, "jitserve_compiles_total", model="gpt") == 0


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"input_ids": list(range(65))}, 400, "input_ids: 65 prompt tokens are past the model's 64 positions"),
        ({"input_ids": [1], "parameters": {"max_tokens": 5000}}, 400, "max_tokens: 5000 is past"),
        ({"input_ids": [1, 1000]}, 400, "input_ids: token id 1000 is not in the vocabulary"),
        ({"input_ids": [1], "parameters": {"max_tokens": 63, "bogus": 1}}, 400, "parameters.bogus"),
        ({"input_ids": [1], "parameters": {"max_tokens": 63}}, 503, "blocks free"),
    ],
)
def test_bad_input_gets_a_clear_error(server, body, status, message):
    with server.client() as client:
        answer = client.post("/v2/models/gpt/generate", json=body)
        assert answer.status_code == status, answer.text
        assert message in answer.text
        assert client.get("/models/gpt").json()["generation"]["cache_blocks"]["used"] == 0


def word_tokenizer(vocab: int = 97) -> bytes:
    """A tokenizer.json of one word per token id: ``w0`` ... ``w96``, split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer.to_str().encode()


def archive(**files: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as bundle:
        for name, data in files.items():
            bundle.writestr(f"decoder/{name.replace('_', '.')}", data)
    return buffer.getvalue()


def test_a_decoder_uploaded_with_its_tokenizer_takes_and_gives_text(server, reference):
    """An archive holding model.onnx and tokenizer.json: text in, the same tokens as its ids, text out, and
    the stream's pieces adding up to it."""
    with server.client() as client:
        response = client.put("/models/texty", content=archive(model_onnx=DECODER, tokenizer_json=word_tokenizer()))
        assert response.status_code == 201, response.text
        body = {"text_input": "w4 w8 w15 w16", "parameters": {"max_tokens": 6}}
        answer = client.post("/v2/models/texty/generate", json=body).json()
        tokens = uncached_greedy(*reference, [4, 8, 15, 16], 6)
        assert answer["output_ids"] == tokens
        assert answer["text_output"] == " ".join(f"w{t}" for t in tokens)
        with client.stream("POST", "/v2/models/texty/generate_stream", json=body) as stream:
            events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: ")]
        assert "".join(e.get("text_output", "") for e in events) == answer["text_output"]
        assert client.get("/models/texty").json()["generation"]["tokenizer"] is True

        without = client.post("/v2/models/gpt/generate", json=body)
        assert without.status_code == 400 and "uploaded without a tokenizer.json" in without.json()["error"]
        both = client.post("/v2/models/texty/generate", json={**body, "input_ids": [1]})
        assert both.status_code == 400 and "one of input_ids and text_input" in both.json()["error"]
        broken = client.put("/models/broken", content=archive(model_onnx=DECODER, tokenizer_json=b"{not json"))
        assert broken.status_code == 400 and "tokenizer.json" in broken.json()["error"]
        assert client.get("/models/broken").status_code == 404


def test_a_model_that_is_no_decoder_is_refused(server):
    from compiler.models.demo import demo_model_bytes

    with server.client() as client:
        assert upload(client, "plain", demo_model_bytes()).status_code == 201
        answer = client.post("/v2/models/plain/generate", json={"input_ids": [1]})
        assert answer.status_code == 400 and "not a decoder with a key/value cache" in answer.json()["error"]
        assert client.post("/v2/models/nothing/generate", json={"input_ids": [1]}).status_code == 404
