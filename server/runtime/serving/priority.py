"""Scheduling priority for the threads that must never slow a served request (cold runs, shadow checks)."""

from __future__ import annotations

import os
import threading


def idle_thread_priority() -> None:
    """Put the calling thread in Linux's idle scheduling class: any runnable thread of normal priority
    preempts it at once (niceness only lowers its share, and its slice still delays a kernel's workers)."""
    os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
