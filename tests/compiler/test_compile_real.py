"""Real PP-OCR models: compile (cls at two batch sizes, rec at one), verify against ONNX Runtime,
reuse from the store in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from compiler.building.build import bucket_key, compile_bucket
from compiler.building.options import CompileOptions
from compiler.building.target import resolve_target
from compiler.models.model import load_model_file
from compiler.running.engines import OrtEngine
from compiler.shapes.padding import check_axis_padding
from compiler.storage.store import KernelStore
from tests.realmodels import CLS, REC, rapidocr_model

pytestmark = pytest.mark.slow

BUCKETS = [
    (CLS, {"x": (1, 3, 48, 192)}),
    (CLS, {"x": (8, 3, 48, 192)}),
    (REC, {"x": (1, 3, 48, 320)}),
]

RELOAD_AND_RUN = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    import numpy as np
    started = time.perf_counter()
    from compiler.running.engines import OrtEngine, TvmEngine
    from compiler.running.arrays import random_inputs
    from compiler.models.weights import load_weights
    spec = json.loads(sys.argv[1])
    weights = load_weights(Path(spec["prepared"]))
    kernel = TvmEngine(spec["library"], ["x"], spec["outputs"], weights=[weights[n] for n in spec["weights"]])
    loaded = time.perf_counter() - started
    inputs = random_inputs({"x": tuple(spec["shape"])}, {"x": "float32"}, 123)
    got = kernel.run(inputs)
    want = OrtEngine(open(spec["model"], "rb").read()).run(inputs)
    error = max(float(np.max(np.abs(got[k] - want[k]))) for k in want)
    print(json.dumps({"load_seconds": loaded, "max_abs_error": error}))
    """
)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return KernelStore(tmp_path_factory.mktemp("kernels"))


@pytest.mark.parametrize(
    ("name", "bucket"), BUCKETS, ids=lambda v: v if isinstance(v, str) else "x".join(map(str, v["x"]))
)
def test_real_model_compiles_verifies_and_reloads(store, name, bucket):
    path = rapidocr_model(name)
    model = load_model_file(str(path), max_bytes=64 << 20)
    target = resolve_target("llvm")

    first = compile_bucket(model, bucket, target, store)
    assert not first.cached
    assert first.manifest.verified is True, first.manifest.verification
    assert first.manifest.max_abs_error < 1e-3
    assert first.manifest.simplified

    again = compile_bucket(model, bucket, target, store)
    assert again.cached
    assert again.manifest.key == first.manifest.key

    # A fresh process loads the stored kernel (no compile) and matches ORT
    # on inputs other than the ones verification used.
    spec = {
        "library": again.library_path,
        "prepared": str(store.prepared_path(model.digest)),
        "weights": again.manifest.weights,
        "outputs": model.signature.output_names,
        "shape": list(bucket["x"]),
        "model": str(path),
    }
    run = subprocess.run(
        [sys.executable, "-c", RELOAD_AND_RUN, json.dumps(spec)], capture_output=True, text=True, check=True
    )
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["max_abs_error"] < 1e-3
    assert result["load_seconds"] < 5


def test_cls_batch_axis_is_padding_safe_and_width_is_not():
    model = load_model_file(str(rapidocr_model(CLS)), max_bytes=64 << 20)
    engine = OrtEngine(model.data)
    sizes = {"x:0": 3, "x:2": 48, "x:3": 192}

    batch = check_axis_padding(engine, model.signature, "x:0", sizes, 4)
    assert batch.safe, batch.reason
    assert batch.output_axes == {model.signature.output_names[0]: [0]}

    width = check_axis_padding(engine, model.signature, "x:3", sizes, 256)
    assert not width.safe
    assert "padding changes the outputs" in width.reason


def test_cuda_compile_without_a_device(store):
    """nvcc compiles CUDA kernels here; running them needs the device."""
    model = load_model_file(str(rapidocr_model(CLS)), max_bytes=64 << 20)
    target = resolve_target("cuda", cuda_arch="sm_90")
    outcome = compile_bucket(model, {"x": (1, 3, 48, 192)}, target, store)
    assert outcome.manifest.target["kind"] == "cuda"
    assert outcome.manifest.library_bytes > 0
    import tvm

    if tvm.cuda(0).exist:
        assert outcome.manifest.verified is True
    else:
        assert outcome.manifest.verified is None
        assert "no CUDA device" in outcome.manifest.verification


def test_compile_options_change_the_key():
    model = load_model_file(str(rapidocr_model(CLS)), max_bytes=64 << 20)
    target = resolve_target("llvm")
    bucket = {"x": (1, 3, 48, 192)}

    def key_with(options: CompileOptions, target: dict = target) -> str:
        return bucket_key(model.graph_digest, bucket, target=target, options=options)

    simplified = key_with(CompileOptions())
    # A stored verdict holds only for the tolerances and inputs it was judged at.
    assert key_with(CompileOptions(rtol=0.5)) != simplified
    assert key_with(CompileOptions(atol=0.5)) != simplified
    assert key_with(CompileOptions(seed=1)) != simplified
    assert key_with(CompileOptions(timeout_seconds=5)) == simplified
    assert key_with(CompileOptions(simplify=False)) != simplified
    assert key_with(CompileOptions(), resolve_target("cuda")) != simplified
