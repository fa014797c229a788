"""The load test end to end, briefly: a real server, real locust, the report files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_short_load_run_writes_summary_and_plot(tmp_path):
    run = subprocess.run(
        [sys.executable, "loadtest/run.py", "--users", "2", "--duration", "6", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["requests"] > 20
    assert summary["errors"] == 0
    assert summary["distinct_shapes"] > 5
    # Many shapes, few buckets: pow2 on both axes folds them together.
    assert 1 <= summary["buckets"] < summary["distinct_shapes"]
    assert summary["compiles"] >= 1
    assert summary["compiles_per_distinct_shape"] == round(summary["compiles"] / summary["distinct_shapes"], 4)
    assert summary["compiles_per_distinct_shape"] < 1
    if summary["kernel_served_requests"]:
        assert 0 <= summary["mean_padding_waste"] < 1
    assert summary["p50_ms"] <= summary["p95_ms"] <= summary["p99_ms"]
    png = (tmp_path / "latency.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
