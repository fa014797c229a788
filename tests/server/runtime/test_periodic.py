"""server.runtime.models.periodic: a background action that outlives its failures and stops when told."""

from __future__ import annotations

import threading

from server.runtime.models.periodic import Periodic


def test_runs_again_after_a_failure_and_stops():
    calls = []
    third = threading.Event()

    def action() -> None:
        calls.append(1)
        if len(calls) == 3:
            third.set()
        if len(calls) == 1:
            raise OSError("a volume hiccup")

    periodic = Periodic("test", action, 0.01, at_start=True)
    periodic.start()
    assert third.wait(5)
    periodic.stop()
    stopped_at = len(calls)
    threading.Event().wait(0.05)
    assert len(calls) == stopped_at  # nothing runs after stop()


def test_not_at_start_waits_one_interval_first():
    ran = threading.Event()
    periodic = Periodic("test", ran.set, 60, at_start=False)
    periodic.start()
    assert not ran.wait(0.1)
    periodic.stop()
    assert not ran.is_set()
