"""A daemon thread running one action every so often, surviving the action's failures."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("jitserve")


class Periodic:
    def __init__(self, name: str, action: Callable[[], object], interval: float, *, at_start: bool) -> None:
        """``action`` every ``interval`` seconds (first at once when ``at_start``); ``name`` names the thread
        (``jitserve-<name>``) and its failures in the log."""
        self.name = name
        self.action = action
        self.interval = interval
        self.at_start = at_start
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"jitserve-{self.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        if not self.at_start and self._stop.wait(self.interval):
            return
        while True:
            try:
                self.action()
            except Exception:  # one bad pass (a volume hiccup) must not end the thread
                log.exception("%s failed; trying again in %g s", self.name, self.interval)
            if self._stop.wait(self.interval):
                return
