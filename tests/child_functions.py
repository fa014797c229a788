"""Module-level targets for ``compiler.building.worker.run_in_child`` tests.

The worker uses the ``spawn`` start method, so a target must be importable by
its qualified name (``tests.child_functions.<name>``) in a fresh interpreter.
Keep this module light: every child imports it.
"""

from __future__ import annotations

import os
import signal
import time

from compiler.errors import UnsupportedOperatorError


def square(value: int) -> int:
    return value * value


def echo_dict(value: dict) -> dict:
    return {"got": value, "pid": os.getpid()}


def raise_unsupported(op: str) -> None:
    raise UnsupportedOperatorError(f"no converter for {op}")


def raise_value_error(text: str) -> None:
    raise ValueError(text)


def segfault(_: object) -> None:
    os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(10)  # not reached: the signal kills the process


def exit_quietly(status: int) -> None:
    os._exit(status)


def sleep_for(seconds: float) -> str:
    time.sleep(seconds)
    return "woke up"


def unpicklable_result(_: object):
    return lambda: None


def niceness(_: object) -> int:
    return os.nice(0)


def die_with_wrong_parent(_: object) -> None:
    """As if the process that started this one had died before it ran: it must not go on."""
    from compiler.building.worker import die_with_parent

    die_with_parent(os.getppid() + 1_000_000)


def allocate(size: int) -> int:
    """Touch ``size`` bytes, as a compile that needs that much memory would."""
    return len(bytearray(size))


def data_limit(_: object) -> int:
    import resource

    return resource.getrlimit(resource.RLIMIT_DATA)[0]


def spin_with_a_helper(seconds: float) -> str:
    """Busy for ``seconds`` here and in a process of its own (as tuning's builders are)."""
    import subprocess
    import sys

    helper = subprocess.Popen(
        [sys.executable, "-c", f"import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass"]
    )
    end = time.time() + seconds
    while time.time() < end:
        pass
    helper.wait()
    return "done"
