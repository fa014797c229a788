"""``python -m compiler``: JSON on success, one line on stderr on failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import synthetic

REPO = Path(__file__).resolve().parents[2]


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "compiler", *args], check=False, capture_output=True, text=True, cwd=REPO,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


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

    # Verified within a budget (a quantized model's int8 contract) instead: another artifact.
    budgeted = cli(*args, "--cosine", "0.999")
    assert budgeted.returncode == 0, budgeted.stderr
    within = json.loads(budgeted.stdout)
    assert within["verified"] is True and within["key"] != built["key"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("inspect", "/nonexistent/model.onnx"), "cannot read"),
        (("compile", "{model}", "--shape", "a=2,8"), "give --shape b="),
        (("compile", "{model}", "--shape", "a=2,8", "--shape", "b=3,8"), "axis 'batch'"),
        (("compile", "{model}", "--shape", "a=2,8,1", "--shape", "b=2,8"), "rank"),
        (("compile", "{model}", "--shape", "a=2,8", "--shape", "b=2,8", "--target", "tpu"), "unknown target"),
        (("compile", "{garbage}", "--shape", "a=2,8"), "not an ONNX model"),
        (("compile", "{model}", "--shape", "a=2,8", "--shape", "b=2,8", "--cosine", "1.5"), "--cosine/--top-k"),
        (("compile", "{model}", "--shape", "a=2,8", "--shape", "b=2,8", "--cuda-graph"), "not llvm ones"),
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


@pytest.mark.slow
def test_bench_prints_one_json_line_per_bucket_and_plots(two_input, tmp_path):
    plot = tmp_path / "ratios.png"
    shapes = ("--shape", "a=2,8", "--shape", "b=2,8", "--shape", "a=4,8", "--shape", "b=4,8")
    args = ("bench", str(two_input), *shapes, "--store", str(tmp_path / "kernels"), "--runs", "3")
    result = cli(*args, "--tune-trials", "4", "--plot", str(plot), env={"JITSERVE_OPENVINO": "1"})
    assert result.returncode == 0, result.stderr
    # Only results on stdout: tuning's progress goes to stderr.
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2, result.stdout[-2000:]
    rows = [json.loads(line) for line in lines]
    assert [r["bucket"] for r in rows] == ["a=2x8,b=2x8", "a=4x8,b=4x8"]
    for row in rows:
        assert row["tvm_verified"] is True and row["tvm_tuned_verified"] is True
        assert row["ort_ms"] > 0 and row["tvm_ms"] > 0 and row["tvm_tuned_ms"] > 0
        # Ratios come from the unrounded times; the printed times are rounded to the microsecond.
        # OpenVINO too (installed, on by default), built for the bucket and verified like a kernel.
        assert row["openvino_verified"] is True and row["openvino_ms"] > 0, row
        assert set(row["ratio_vs_ort"]) == {"tvm", "tvm_tuned", "openvino"}
        for tier in ("tvm", "tvm_tuned", "openvino"):
            assert row["ratio_vs_ort"][tier] == pytest.approx(row[f"{tier}_ms"] / row["ort_ms"], rel=0.25)
        # The faster peer is the one a kernel must beat to serve: min(ONNX Runtime, OpenVINO).
        assert row["peer_ms"] == min(row["ort_ms"], row["openvino_ms"]), row
        assert set(row["ratio_vs_peer"]) == {"tvm", "tvm_tuned"}
        for tier in ("tvm", "tvm_tuned"):
            assert row["ratio_vs_peer"][tier] == pytest.approx(row[f"{tier}_ms"] / row["peer_ms"], rel=0.25)
        assert row["compile_seconds"] > 0 and row["tune_seconds"] > 0 and row["tune_trials"] >= 1
        assert row["precision"] == {"onnxruntime": "fp32", "tvm": "fp32", "openvino": "fp32"}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bf16_is_refused_on_a_cpu_without_a_bf16_unit(two_input, tmp_path):
    from compiler.building.matrix_units import host_matrix_units

    missing = host_matrix_units().missing("bf16")
    if missing is None:
        pytest.skip("this CPU has a bf16 unit (AVX512-BF16 or AMX): --precision bf16 compiles here")
    args = ("compile", str(two_input), "--shape", "a=2,8", "--shape", "b=2,8", "--precision", "bf16")
    result = cli(*args, "--store", str(tmp_path / "s"))
    assert result.returncode != 0 and result.stderr.strip() == f"error: --precision bf16: {missing}"
    assert not (tmp_path / "s").exists() or not any((tmp_path / "s").rglob("manifest.json"))


@pytest.mark.parametrize(
    ("precision", "target", "units"),
    [("f16", "llvm", "CUDA's tensor cores"), ("bf16", "cuda", "the CPU's matrix units")],
)
def test_a_precision_is_refused_for_the_target_it_is_not_compiled_for(two_input, tmp_path, precision, target, units):
    args = ("compile", str(two_input), "--shape", "a=2,8", "--shape", "b=2,8", "--precision", precision)
    result = cli(*args, "--target", target, "--store", str(tmp_path / "s"))
    expected = f"error: --precision {precision} compiles for {units} only, not for {target}"
    assert result.returncode != 0 and result.stderr.strip() == expected
    assert not (tmp_path / "s").exists() or not any((tmp_path / "s").rglob("manifest.json"))
