"""server.runtime.memory.memory_guard: the memory limit uploads are admitted against."""

from __future__ import annotations

import psutil
import pytest

from compiler.errors import InsufficientMemoryError
from server.runtime.memory.memory_guard import UPLOAD_WEIGHT_FACTOR, MemoryGuard, detected_memory_limit
from server.runtime.observability.metrics import Metrics


def test_the_detected_limit_is_the_containers_or_the_machines():
    assert 0 < detected_memory_limit() <= psutil.virtual_memory().total


def test_weights_are_admitted_while_they_fit_and_zero_checks_nothing():
    held = psutil.Process().memory_info().rss
    guard = MemoryGuard(held + 2**30, Metrics(), lambda: 0)
    guard.check_upload("fits", int(2**29 / UPLOAD_WEIGHT_FACTOR))
    with pytest.raises(InsufficientMemoryError, match="'too_big' does not fit in memory") as refused:
        guard.check_upload("too_big", 2**30)
    assert refused.value.http_status == 507
    MemoryGuard(0, Metrics(), lambda: 0).check_upload("unchecked", 2**50)
