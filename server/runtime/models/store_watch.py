"""Replicas on one shared model store follow each other: a poll of the
store's versions notices what another replica uploaded, replaced or deleted,
and serves it here too (the file system offers no change events across
machines: inotify sees local writes only)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..observability.metrics import Metrics
from .periodic import Periodic
from .records import ModelStore

log = logging.getLogger("jitserve")


class StoreWatch:
    def __init__(
        self, models: ModelStore, follow: Callable[[str], str | None], metrics: Metrics, *, interval: float
    ) -> None:
        """``follow(name)`` brings one changed name up to date and says what it changed."""
        self.models = models
        self.follow = follow
        self.metrics = metrics
        self.interval = interval
        self._seen: dict[str, int] = {}
        self._periodic = Periodic("store-watch", self.poll, interval, at_start=False)

    def remember(self) -> None:
        """The store as it is now: what this replica serves at start (changes are what comes after)."""
        self._seen = self.models.current_versions()

    def start(self) -> None:
        if self.interval > 0:
            self._periodic.start()

    def stop(self) -> None:
        self._periodic.stop()

    def poll(self) -> list[tuple[str, str]]:
        """Follow every name whose newest stored version changed since the last poll; the changes made."""
        current = self.models.current_versions()
        seen = self._seen
        changed = sorted(name for name in current.keys() | seen.keys() if current.get(name) != seen.get(name))
        made = []
        for name in changed:
            change = self.follow(name)
            if change is not None:
                self.metrics.fleet.record_store_follow(change=change)
                log.info("model store: %s %s (changed by another replica)", name, change.replace("_", " "))
                made.append((name, change))
        self._seen = current
        return made
