"""Run one function in a child process, so that a TVM crash or hang fails
that one call and never its caller."""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import multiprocessing
import os
import resource
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from .. import errors
from ..errors import CompileCrashedError, CompileError, CompileOutOfMemoryError, CompileTimeoutError, JitServeError

# spawn, not fork: the caller may run threads (uvicorn, ORT) that fork would copy.
_CONTEXT = multiprocessing.get_context("spawn")


PR_SET_PDEATHSIG = 1

_running: set[multiprocessing.process.BaseProcess] = set()
_running_lock = threading.Lock()


def stop_children() -> int:
    """Kill every child ``run_in_child`` is waiting on (a shutdown); each caller gets a
    CompileCrashedError. Returns how many were running."""
    with _running_lock:
        running = list(_running)
    for process in running:
        with contextlib.suppress(OSError, ValueError):
            process.kill()
    return len(running)


def die_with_parent(parent_pid: int) -> None:
    """Have Linux kill this process when its parent dies, even by SIGKILL (no cleanup runs there); exit
    now if the parent died before this was set."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(1)


def watch_parent(parent_pid: int, interval: float = 0.5) -> threading.Thread:
    """A daemon thread that ends this process once its parent is gone (it is then re-parented): for a
    child that may wait forever on its parent, where the parent-death signal alone may not reach it
    (the signal follows the *thread* that started the child, not the process)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval)
        os._exit(1)

    thread = threading.Thread(target=watch, name="jitserve-parent-watch", daemon=True)
    thread.start()
    return thread


@contextlib.contextmanager
def children_paused():
    """Every child ``run_in_child`` is waiting on, and the processes it started (tuning's builders and
    runners), stopped while the block runs; yields how many were. An engine timed on shared cores beside a
    compile is not timed fairly: TVM's threads wait at each parallel loop's barrier for the one a compile
    displaced, so ResNet-50's kernel measured 48.9 ms beside a compile and 34.2 in the bench. A child
    whose parent dies while it is stopped still dies: its parent-death signal is SIGKILL, which a stopped
    process takes too."""
    import psutil

    with _running_lock:
        pids = [process.pid for process in _running if process.pid is not None]
    stopped: list[psutil.Process] = []
    try:
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                root = psutil.Process(pid)
                for process in (root, *root.children(recursive=True)):
                    with contextlib.suppress(psutil.Error):
                        process.suspend()
                        stopped.append(process)
        yield len(stopped)
    finally:
        for process in reversed(stopped):
            with contextlib.suppress(psutil.Error):
                process.resume()


def _child_main(function_path: tuple[str, str], argument: Any, connection, parent_pid: int, memory_limit: int) -> None:
    die_with_parent(parent_pid)
    try:
        # The limit first, then the import: a child that cannot even import what it runs says so.
        limit_memory(memory_limit)
        module, name = function_path
        result = getattr(importlib.import_module(module), name)(argument)
    except MemoryError:
        connection.send(("error", "CompileOutOfMemoryError", f"ran out of its memory limit of {memory_limit} bytes"))
    except JitServeError as exc:
        connection.send(("error", type(exc).__name__, str(exc)))
    except BaseException as exc:  # noqa: BLE001 - report everything to the parent
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        message = lines[-1] if lines else ""
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()[0]
        connection.send(("error", "CompileError", f"{type(exc).__name__}: {message or detail}"))
    else:
        try:
            connection.send(("ok", result))
        except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable result
            connection.send(("error", "CompileError", f"result could not be sent back: {exc}"))
    finally:
        connection.close()


def _describe_exit(exitcode: int | None, memory_limit: int) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            text = f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            text = f"killed by signal {-exitcode}"
        # C++ code aborts or crashes where Python would raise MemoryError.
        if memory_limit and -exitcode in (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS):
            text += f" (its memory limit was {memory_limit} bytes)"
        return text
    return f"exited with status {exitcode} without a result"


def limit_memory(limit: int) -> None:
    """Cap this process's data segment (heap and private writable mappings). Not RLIMIT_AS: CUDA reserves
    address space far past what it ever touches."""
    if limit:
        hard = resource.getrlimit(resource.RLIMIT_DATA)[1]
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)  # only root may raise a hard limit
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def run_in_child(
    function: Callable[[Any], Any],
    argument: Any,
    *,
    timeout: float,
    what: str = "compile",
    nice: int = 0,
    idle_priority: bool = False,
    memory_limit: int = 0,
) -> Any:
    """Call ``function(argument)`` in a fresh process (``nice`` added to its niceness, in the idle
    scheduling class with ``idle_priority``, its data segment capped at ``memory_limit`` bytes unless
    0) and return its result.

    Raises CompileTimeoutError past ``timeout`` seconds, CompileCrashedError
    when the child dies without answering, CompileOutOfMemoryError when it
    ran out of its memory limit, and the child's own typed error (or
    CompileError) when it raised.
    """
    receiver, sender = _CONTEXT.Pipe(duplex=False)
    # A compile never outlives the process that asked for it: daemon for a clean exit, the parent-death
    # signal for a killed one.
    process = _CONTEXT.Process(
        target=_child_main,
        # By name: the child imports it within its memory limit.
        args=((function.__module__, function.__qualname__), argument, sender, os.getpid(), memory_limit),
        name=f"jitserve-{what}",
        daemon=True,
    )
    process.start()
    with _running_lock:
        _running.add(process)
    # At once, not only when the child gets to it: its imports run below serving too.
    if nice:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, process.pid, os.getpriority(os.PRIO_PROCESS, 0) + nice)
    if idle_priority:
        with contextlib.suppress(OSError, AttributeError):
            os.sched_setscheduler(process.pid, os.SCHED_IDLE, os.sched_param(0))
    sender.close()
    try:
        if not receiver.poll(timeout):
            raise CompileTimeoutError(f"{what} ran past {timeout:g} s and was stopped")
        try:
            message = receiver.recv()
        except (EOFError, OSError):
            process.join(5)
            raise CompileCrashedError(f"{what} process {_describe_exit(process.exitcode, memory_limit)}") from None
    finally:
        receiver.close()
        if process.is_alive():
            process.kill()
        process.join()
        with _running_lock:
            _running.discard(process)
    if message[0] == "ok":
        return message[1]
    _, class_name, text = message
    if class_name == CompileOutOfMemoryError.__name__:
        text = f"{what} {text}"
    error_class = getattr(errors, class_name, CompileError)
    if not (isinstance(error_class, type) and issubclass(error_class, JitServeError)):
        error_class = CompileError
    raise error_class(text)
