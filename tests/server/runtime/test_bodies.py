"""The body budget and JSON parsing in a child process."""

from __future__ import annotations

import asyncio

import numpy as np
import orjson
import pytest

from compiler.errors import BadRequestError, UnavailableError
from server.runtime.serving.bodies import PROCESS_PARSE_BYTES, BodyBudget, JsonParsers


def test_a_body_waits_for_room_and_gets_it_when_another_is_released():
    async def scenario() -> list[str]:
        budget, events = BodyBudget(100, wait_seconds=5), []
        await budget.reserve(60)

        async def second() -> None:
            await budget.reserve(60)
            events.append("second in")

        waiting = asyncio.create_task(second())
        await asyncio.sleep(0.05)
        events.append(f"held {budget.held}")
        budget.release(60)
        await waiting
        events.append(f"held {budget.held}")
        return events

    assert asyncio.run(scenario()) == ["held 60", "second in", "held 60"]


def test_a_body_that_waits_too_long_is_503_and_holds_nothing():
    async def scenario() -> int:
        budget = BodyBudget(100, wait_seconds=0.05)
        await budget.reserve(60)
        with pytest.raises(UnavailableError, match="hold 60 bytes of the 100 budget; a 50-byte body waited"):
            await budget.reserve(50)
        return budget.held

    assert asyncio.run(scenario()) == 60


def test_a_body_over_the_whole_budget_runs_alone():
    async def scenario() -> None:
        budget = BodyBudget(100, wait_seconds=0.05)
        await budget.reserve(500)  # nothing else held: let in
        with pytest.raises(UnavailableError):
            await budget.reserve(1)
        budget.release(500)
        await budget.reserve(1)

    asyncio.run(scenario())


def test_no_budget_holds_nothing():
    async def scenario() -> int:
        budget = BodyBudget(0, wait_seconds=0)
        for _ in range(3):
            await budget.reserve(10**9)
        return budget.held

    assert asyncio.run(scenario()) == 0


def big_body(inputs: dict) -> bytes:
    body = orjson.dumps({"model": "m", "inputs": inputs, "pad": "." * PROCESS_PARSE_BYTES})
    assert len(body) > PROCESS_PARSE_BYTES
    return body


def test_a_large_body_is_parsed_in_a_child_into_arrays():
    parsers = JsonParsers(1)
    try:
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        parsed = asyncio.run(parsers.parse(big_body({"x": x.tolist(), "ragged": [[1], [2, 3]], "text": ["a"]})))
        assert parsed["model"] == "m"
        np.testing.assert_array_equal(parsed["inputs"]["x"], x)
        # what is not a rectangular numeric array stays as sent, for the request's own checks to name
        assert parsed["inputs"]["ragged"] == [[1], [2, 3]]
        assert parsed["inputs"]["text"] == ["a"]
        with pytest.raises(BadRequestError, match="malformed JSON"):
            asyncio.run(parsers.parse(big_body({"x": [1]})[:-1]))
        with pytest.raises(BadRequestError, match="must be an object"):
            asyncio.run(parsers.parse(orjson.dumps([0] * PROCESS_PARSE_BYTES)))
    finally:
        parsers.close()
