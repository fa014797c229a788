"""The C allocator's hold on freed memory (glibc's malloc; elsewhere these do nothing).

glibc raises its mmap threshold each time a mapped block is freed (up to 32 MiB), so after the first
model most tensors (ONNX Runtime's copy of the weights, parsed protobufs) come from the heap, where a
deleted model's blocks sit between live ones and ``malloc_trim`` cannot hand all of them back. Measured
(4-layer hidden-768 encoder, 108 MiB of weights, uploaded, served and deleted five times): the server
kept 5, 14, 23, 23, 23 MiB more after each round with glibc's default, 4 MiB every round with a fixed
threshold of 1 MiB. The price: a block past the threshold is mapped afresh each time (about 0.4 ms for
a 1 MiB array against 0.02 ms from the heap), which only requests with tensors of a MiB or more pay.
"""

from __future__ import annotations

import ctypes
import gc
import threading

_libc = ctypes.CDLL(None)
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h


def return_memory() -> None:
    """Hand freed memory back to the system: glibc keeps freed heap pages (and arenas) otherwise."""
    gc.collect()
    trim = getattr(_libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


def return_memory_now_and_after(delays: tuple[float, ...], *, now: bool = True) -> None:
    """Hand freed memory back now (or, not ``now``, at once in a thread of its own), and again after each of
    ``delays`` seconds (what is still held for a while, by requests in flight or work ending, is freed by
    then)."""
    if now:
        return_memory()
    for seconds in delays if now else (0.0, *delays):
        timer = threading.Timer(seconds, return_memory)
        timer.daemon = True
        timer.start()


def fix_mmap_threshold(size: int) -> bool:
    """Blocks of ``size`` bytes or more are mapped on their own, and unmapped when freed; 0 keeps glibc's
    moving threshold. True when applied."""
    mallopt = getattr(_libc, "mallopt", None)
    if not size or mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, size))
