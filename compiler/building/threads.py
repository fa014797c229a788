"""One thread plan per process for both engines.

Measured on 2 cores: TVM's runtime sizes its pool to half the hardware
threads (it assumes hyper-threading), so it ran kernels on one core while
ONNX Runtime used two. TVM now gets every usable core, as ONNX Runtime does
by default (one pinned thread per physical core), or both get the count
set. And ONNX Runtime's intra-op threads spin after each call: a TVM call
right after an ONNX Runtime call in the same process ran 4-13x slower (its
workers waited for the cores the spinners held), so the server's ONNX
Runtime sessions do not spin unless asked to.
"""

from __future__ import annotations

import os

from .target import host_cores


def apply_thread_plan(kernel_threads: int, *, spinning: bool = True) -> int:
    """Size TVM's thread pools for this process and the compile and tuning children it spawns.

    TVM reads ``TVM_NUM_THREADS`` when a thread first creates its pool, and
    children inherit the environment, so MetaSchedule measures candidates
    with the thread count that serving uses. ``spinning=False`` stops TVM's
    idle workers spinning too, the policy the server gives ONNX Runtime: both
    engines are timed and served alike. Returns the count.
    """
    threads = kernel_threads or host_cores()
    os.environ["TVM_NUM_THREADS"] = str(threads)
    if not spinning:
        os.environ["TVM_THREAD_POOL_SPIN_COUNT"] = "0"
    return threads
