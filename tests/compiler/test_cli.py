"""``python -m compiler``: JSON on success, one line on stderr on failure."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import synthetic

REPO = Path(__file__).resolve().parents[2]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "compiler", *args], check=False, capture_output=True, text=True, cwd=REPO
    )


@pytest.fixture
def two_input(tmp_path):
    path = tmp_path / "two.onnx"
    path.write_bytes(synthetic.two_input_model())
    return path


def test_inspect_prints_signature(two_input):
    result = cli("inspect", str(two_input))
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert [i["name"] for i in info["inputs"]] == ["a", "b"]
    assert info["symbolic_axes"]["batch"] == [{"input": "a", "axis": 0}, {"input": "b", "axis": 0}]


def test_compile_then_cached(two_input, tmp_path):
    store = tmp_path / "kernels"
    args = ("compile", str(two_input), "--shape", "a=2,8", "--shape", "b=2,8", "--store", str(store))
    first = cli(*args)
    assert first.returncode == 0, first.stderr
    built = json.loads(first.stdout)
    assert built["cached"] is False and built["verified"] is True
    assert set(built) >= {
        "key",
        "artifact",
        "bucket",
        "target",
        "compile_seconds",
        "cached",
        "verified",
        "max_abs_error",
    }

    started = time.perf_counter()
    second = cli(*args)
    elapsed = time.perf_counter() - started
    reused = json.loads(second.stdout)
    assert reused["cached"] is True
    assert reused["key"] == built["key"]
    # Generous bound on a whole interpreter start: a compile takes several seconds.
    assert elapsed < 5


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("inspect", "/nonexistent/model.onnx"), "cannot read"),
        (("compile", "{model}", "--shape", "a=2,8"), "give --shape b="),
        (("compile", "{model}", "--shape", "a=2,8", "--shape", "b=3,8"), "axis 'batch'"),
        (("compile", "{model}", "--shape", "a=2,8,1", "--shape", "b=2,8"), "rank"),
        (("compile", "{model}", "--shape", "a=2,8", "--shape", "b=2,8", "--target", "tpu"), "unknown target"),
        (("compile", "{garbage}", "--shape", "a=2,8"), "not an ONNX model"),
    ],
)
def test_bad_input_gives_one_line_error(two_input, tmp_path, args, message):
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x00\x01 definitely not onnx" * 10)
    args = [a.format(model=two_input, garbage=garbage) for a in args]
    result = cli(*args, "--store", str(tmp_path / "s")) if args[0] == "compile" else cli(*args)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert message in lines[0]
    assert "Traceback" not in result.stderr
