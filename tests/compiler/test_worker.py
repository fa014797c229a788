"""compiler.building.worker.run_in_child: results, typed errors, crashes, timeouts."""

from __future__ import annotations

import os
import resource
import threading
import time

import pytest

from compiler.building import worker
from compiler.building.worker import run_in_child, stop_children
from compiler.errors import (
    BadRequestError,
    CompileCrashedError,
    CompileError,
    CompileOutOfMemoryError,
    CompileTimeoutError,
    UnsupportedOperatorError,
)
from tests import child_functions


def test_returns_the_result_of_a_module_level_function():
    assert run_in_child(child_functions.square, 7, timeout=30) == 49


def test_runs_in_another_process_and_pickles_arguments():
    result = run_in_child(child_functions.echo_dict, {"a": [1, 2], "b": b"\x00"}, timeout=30)
    assert result["got"] == {"a": [1, 2], "b": b"\x00"}
    assert result["pid"] != os.getpid()


def test_jitserve_error_subclass_keeps_its_class():
    with pytest.raises(UnsupportedOperatorError, match="no converter for Det") as info:
        run_in_child(child_functions.raise_unsupported, "Det", timeout=30)
    assert type(info.value) is UnsupportedOperatorError
    assert info.value.http_status == 500


def test_other_exception_becomes_compile_error_naming_its_type():
    with pytest.raises(CompileError, match="ValueError: broken input") as info:
        run_in_child(child_functions.raise_value_error, "broken input", timeout=30)
    assert type(info.value) is CompileError


def test_segfault_raises_crashed_and_the_caller_goes_on():
    with pytest.raises(CompileCrashedError, match="SIGSEGV"):
        run_in_child(child_functions.segfault, None, timeout=30)
    # The parent survived and can run the next child.
    assert run_in_child(child_functions.square, 3, timeout=30) == 9


def test_exit_without_an_answer_raises_crashed_with_the_status():
    with pytest.raises(CompileCrashedError, match="status 3"):
        run_in_child(child_functions.exit_quietly, 3, timeout=30)


def test_unpicklable_result_fails_as_a_compile_error():
    with pytest.raises(CompileError):
        run_in_child(child_functions.unpicklable_result, None, timeout=30)


def test_timeout_kills_the_child():
    started = time.monotonic()
    with pytest.raises(CompileTimeoutError, match="ran past 1 s") as info:
        run_in_child(child_functions.sleep_for, 60.0, timeout=1.0, what="probe")
    assert str(info.value).startswith("probe ")
    assert time.monotonic() - started < 10
    assert issubclass(CompileTimeoutError, CompileError)
    assert not issubclass(CompileTimeoutError, BadRequestError)


def test_the_child_runs_below_its_parent():
    mine = os.nice(0)
    assert run_in_child(child_functions.niceness, None, timeout=30, nice=10) == min(19, mine + 10)
    assert run_in_child(child_functions.niceness, None, timeout=30) == mine


def test_a_child_past_its_memory_limit_fails_as_out_of_memory_and_the_next_one_runs():
    limit = 512 * 1024**2
    assert run_in_child(child_functions.data_limit, None, timeout=30, memory_limit=limit) == limit
    with pytest.raises(CompileOutOfMemoryError, match=f"compile ran out of its memory limit of {limit} bytes"):
        run_in_child(child_functions.allocate, 2 * limit, timeout=60, memory_limit=limit)
    assert run_in_child(child_functions.allocate, limit // 4, timeout=60, memory_limit=limit) == limit // 4
    # no limit by default: the server's own limit (none here) is inherited
    assert run_in_child(child_functions.data_limit, None, timeout=30) == resource.getrlimit(resource.RLIMIT_DATA)[0]


def test_stop_children_ends_every_running_child_and_its_caller_goes_on():
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            run_in_child(child_functions.sleep_for, 60, timeout=120)
        except CompileCrashedError as exc:
            outcome.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    deadline = time.monotonic() + 30
    while not worker._running and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    assert stop_children() == 1
    caller.join(10)
    assert time.monotonic() - started < 5
    assert outcome and "killed by SIGKILL" in str(outcome[0])
    assert stop_children() == 0


def test_children_paused_stops_every_child_and_its_own_processes_then_resumes_them():
    """An engine is timed with the compiles stopped: the child and the processes it started are stopped
    (no CPU time) within the block, and run again after it."""
    import psutil

    from compiler.building.worker import children_paused

    result: list[str] = []
    caller = threading.Thread(
        target=lambda: result.append(run_in_child(child_functions.spin_with_a_helper, 4, timeout=60))
    )
    caller.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the child and its helper both started
        with worker._running_lock:
            pids = [p.pid for p in worker._running]
        if pids and psutil.Process(pids[0]).children():
            break
        time.sleep(0.05)
    child = psutil.Process(pids[0])
    family = [child, *child.children(recursive=True)]
    with children_paused() as paused:
        assert paused == 2
        stopping = time.monotonic() + 5  # SIGSTOP is delivered asynchronously
        while {p.status() for p in family} != {psutil.STATUS_STOPPED} and time.monotonic() < stopping:
            time.sleep(0.01)
        assert {p.status() for p in family} == {psutil.STATUS_STOPPED}
        before = [sum(p.cpu_times()[:2]) for p in family]
        time.sleep(0.5)
        assert [sum(p.cpu_times()[:2]) for p in family] == before
    assert psutil.STATUS_STOPPED not in {p.status() for p in family}
    caller.join(30)
    assert result == ["done"]
    with children_paused() as paused:  # nothing running: nothing to stop
        assert paused == 0


def test_the_child_kills_itself_when_its_parent_is_already_gone():
    # the parent-death signal can only be set once the child runs: a parent gone by then means exit at once
    with pytest.raises(CompileCrashedError, match="exited with status 1"):
        run_in_child(child_functions.die_with_wrong_parent, None, timeout=60)
