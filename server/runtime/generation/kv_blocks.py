"""The key/value cache's memory, counted in blocks of positions as vLLM pages it: a sequence reserves the
blocks its prompt and ``max_tokens`` can fill before it starts, so a running sequence never runs out; one
that cannot get them is refused with the reason (or waits in a bounded queue), never an OOM."""

from __future__ import annotations

import math
import threading

from compiler.errors import UnavailableError


class CacheFullError(UnavailableError):
    """No cache blocks for a sequence now: 503, retry later."""


class KvBlocks:
    """``total`` blocks of ``block_positions`` positions each, ``bytes_per_position`` a position."""

    def __init__(self, total: int, block_positions: int, bytes_per_position: int) -> None:
        self.total = total
        self.block_positions = block_positions
        self.bytes_per_position = bytes_per_position
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        return self._used

    @property
    def block_bytes(self) -> int:
        return self.block_positions * self.bytes_per_position

    def blocks_for(self, positions: int) -> int:
        return math.ceil(positions / self.block_positions)

    def reserve(self, positions: int) -> int:
        """Reserve the blocks ``positions`` fill; how many. :class:`CacheFullError` where they are not free."""
        blocks = self.blocks_for(positions)
        with self._lock:
            if blocks > self.total - self._used:
                raise CacheFullError(
                    f"the key/value cache has {self.total - self._used} of {self.total} blocks free "
                    f"({self.block_positions} positions each); this sequence needs {blocks} for {positions} positions"
                )
            self._used += blocks
        return blocks

    def release(self, blocks: int) -> None:
        with self._lock:
            self._used -= blocks
