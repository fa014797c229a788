"""Request bodies in memory: a budget on the bytes held at once, and JSON
parsing that never stalls the event loop.

Parsing a 16 MiB JSON body holds Python's GIL for ~100 ms (orjson) plus
~35 ms (nested lists to an array); on a thread that still blocks every other
request and ``/healthz``. Bodies past ``PROCESS_PARSE_BYTES`` are parsed in a
child process, which hands back arrays. The budget counts the bytes of the
bodies being served (JSON parses to several times its size): a request past
it waits for others to finish, and past a bound answers 503.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson

from compiler.building.worker import die_with_parent, watch_parent
from compiler.errors import BadRequestError, JitServeError, UnavailableError

PROCESS_PARSE_BYTES = 1 << 20
STOP_SECONDS = 3.0
"""How long a closing server waits for its parsers to exit before it kills them."""


def _start_parser(parent_pid: int) -> None:
    """A parser dies with its server, however the server ends: the parent-death signal for a kill, and a
    watch on its parent besides (it idles on its queue for good otherwise)."""
    die_with_parent(parent_pid)
    watch_parent(parent_pid)


def parse_json_object(body: bytes) -> dict[str, Any]:
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequestError(f"malformed JSON: {exc}") from None
    if not isinstance(value, dict):
        raise BadRequestError("the JSON body must be an object")
    return value


def parse_json_tensors(body: bytes) -> dict[str, Any]:
    """A JSON object whose ``inputs`` values become arrays where they are rectangular and numeric (the rest
    stays as parsed, for the request's checks to name)."""
    value = parse_json_object(body)
    inputs = value.get("inputs")
    if isinstance(inputs, dict):
        for name, data in inputs.items():
            try:
                array = np.asarray(data)
            except ValueError:
                continue
            if array.dtype.kind in "biuf":
                inputs[name] = array
    return value


class JsonParsers:
    """Child processes that parse large JSON bodies (started at first use)."""

    def __init__(self, processes: int) -> None:
        self.processes = processes
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    async def parse(self, body: bytes) -> dict[str, Any]:
        if self.processes == 0 or len(body) <= PROCESS_PARSE_BYTES:
            return parse_json_object(body)
        if self._pool is None:
            # spawn: the server has threads, and a forked copy of a lock held by one of them never opens
            context = multiprocessing.get_context("spawn")
            self._pool = concurrent.futures.ProcessPoolExecutor(
                self.processes, mp_context=context, initializer=_start_parser, initargs=(os.getpid(),)
            )
        try:
            future = self._pool.submit(parse_json_tensors, body)
        except RuntimeError:
            raise UnavailableError("server is shutting down") from None
        try:
            return await asyncio.wrap_future(future)
        except concurrent.futures.process.BrokenProcessPool:
            self._pool = None  # a parser died (killed from outside): the next body starts a new pool
            raise UnavailableError("the JSON parser process died; retry") from None

    def close(self) -> None:
        """Stop the parsers and wait for them to exit (killed past ``STOP_SECONDS``): a pool shut down
        without waiting leaves its workers to exit on their own, after the server."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        workers = list((pool._processes or {}).values())  # the pool keeps them private
        pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + STOP_SECONDS
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))
            if worker.is_alive():
                worker.kill()
                worker.join(1)


class BodyBudget:
    """Bytes of request bodies held at once, at most ``limit`` (0: unbounded); one body over the limit
    is let in alone. Used from the event loop only: a body that fits costs no lock and no await."""

    def __init__(self, limit: int, wait_seconds: float) -> None:
        self.limit = limit
        self.wait_seconds = wait_seconds
        self.held = 0
        self._room: asyncio.Event | None = None
        """Set (and replaced) at each release, for the bodies waiting to look again."""

    def _fits(self, size: int) -> bool:
        return self.held == 0 or self.held + size <= self.limit

    def try_reserve(self, size: int) -> bool:
        """Hold ``size`` bytes now if they fit."""
        if self.limit == 0:
            return True
        if not self._fits(size):
            return False
        self.held += size
        return True

    async def reserve(self, size: int) -> None:
        """Hold ``size`` bytes; wait for room up to ``wait_seconds``, then 503. Pair with :meth:`release`."""
        if self.try_reserve(size):
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_seconds
        while not self._fits(size):
            if self._room is None:
                self._room = asyncio.Event()
            try:
                await asyncio.wait_for(self._room.wait(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise UnavailableError(
                    f"request bodies in flight hold {self.held} bytes of the {self.limit} budget; "
                    f"a {size}-byte body waited {self.wait_seconds:g} s: retry later"
                ) from None
        self.held += size

    def release(self, size: int) -> None:
        if self.limit == 0:
            return
        self.held -= size
        if self._room is not None:
            self._room.set()
            self._room = None


class BodyRoom:
    """``async with``: room for a ``size``-byte request body in the budget, held until the block ends; a
    refusal (503 past the wait) is reported to ``refused`` first. A body that fits costs no await."""

    __slots__ = ("budget", "refused", "size")

    def __init__(self, budget: BodyBudget, size: int, refused: Callable[[JitServeError], None]) -> None:
        self.budget = budget
        self.size = size
        self.refused = refused

    async def __aenter__(self) -> None:
        if self.budget.try_reserve(self.size):
            return
        try:
            await self.budget.reserve(self.size)
        except JitServeError as exc:
            self.refused(exc)
            raise

    async def __aexit__(self, *exc_info: object) -> None:
        self.budget.release(self.size)
