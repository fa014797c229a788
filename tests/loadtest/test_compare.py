"""The compare mode end to end, briefly: both servers under wrk, gRPC under h2load, every load answered,
the table."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_compare_runs_both_servers_under_every_load(tmp_path):
    for program, package in (("wrk", "wrk"), ("h2load", "nghttp2-client")):
        if shutil.which(program) is None:
            pytest.fail(f"{program} not found: apt-get install {package} (.ci/system-packages, run by make test)")
    command = ["loadtest/compare.py", "--models", "demo", "--connections", "2", "--duration", "1"]
    run = subprocess.run(
        [sys.executable, *command, "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "compare.jsonl").read_text().splitlines()]
    loads = {(r["server"], r["load"]) for r in rows if "rps" in r}
    assert loads == {
        ("naive (thread pool)", "JSON"),
        ("naive (inline async)", "JSON"),
        ("jitserve", "JSON"),
        ("jitserve", "V2 binary"),
        ("jitserve", "V2 binary, dynamic batching"),
        ("jitserve", "gRPC raw"),
        ("jitserve", "gRPC raw, dynamic batching"),
    }
    for row in rows:
        if "rps" in row:
            assert row["rps"] > 0 and row["errors"] == 0, row
            assert 0 < row["p50_ms"] <= row["p99_ms"], row
    overhead = next(r for r in rows if "beyond_engine_p50_ms" in r)
    assert 0 < overhead["engine_p50_ms"] < overhead["rtt_p50_ms"]
    assert "| demo | 2 | jitserve, V2 binary | " in run.stdout
    assert "| demo | 2 | jitserve, gRPC raw | " in run.stdout
    assert "vs naive reference" in run.stdout and "vs V2 binary" in run.stdout
