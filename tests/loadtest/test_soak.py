"""The soak's short form: 16 clients for 20 s of shape and model churn against a real server with
compiles on; no error, the server alive, the RSS curve and figures written (the 10-minute form is
``loadtest/soak.py`` with its defaults)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_short_soak_has_no_error_and_writes_its_rss_curve(tmp_path):
    out = tmp_path / "soak"
    command = [sys.executable, "loadtest/soak.py", "--clients", "16", "--minutes", "0.33", "--warmup-minutes", "0.1"]
    run = subprocess.run(
        [*command, "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600, check=False
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["errors"] == 0 and result["server_alive_at_end"]
    kinds = {key.split()[0] for key in result["statuses"]}
    assert kinds == {"predict", "infer", "upload", "churn-predict", "delete"}
    assert result["requests"] > 200
    assert len(result["samples"]) >= 10 and all(rss > 0 for _, rss, _ in result["samples"])
    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG")
    assert "latency p50" in run.stdout and "server RSS after warm-up" in run.stdout
