"""server.settings: combinations of settings refused at start."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from server.settings import Settings


def test_a_sweep_interval_past_the_grace_period_is_refused(tmp_path):
    with pytest.raises(ValidationError, match="kernel_store_sweep_seconds must be shorter"):
        Settings(data_dir=tmp_path, kernel_store_grace_seconds=30, kernel_store_sweep_seconds=60)
    assert Settings(data_dir=tmp_path, kernel_store_grace_seconds=30, kernel_store_sweep_seconds=5)
