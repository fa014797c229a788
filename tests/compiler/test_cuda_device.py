"""CUDA kernels compiled, loaded and run on a real GPU, verified against ONNX Runtime (its CUDA
provider where installed, else its CPU one): PP-OCR's three models at several buckets, a BERT-style
encoder and the zoo's convnet blocks. Skipped where no CUDA device is present (CI has none)."""

from __future__ import annotations

import numpy as np
import pytest

from compiler.building.build import compile_bucket, open_kernel
from compiler.building.target import resolve_target
from compiler.models.model import load_model
from compiler.models.weights import load_weights
from compiler.running.arrays import random_inputs
from compiler.running.engines import OrtEngine, TvmEngine
from compiler.storage.store import KernelStore
from tests import convnets
from tests.realmodels import CLS, DET, REC, rapidocr_model
from tests.synthetic import bert_encoder_model


def _cuda_present() -> bool:
    try:
        import tvm

        return bool(tvm.cuda(0).exist)
    except Exception:  # noqa: BLE001 - no runtime, no device
        return False


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not _cuda_present(), reason="needs a CUDA device"),
]

CASES = {
    "cls-b1": (lambda: rapidocr_model(CLS).read_bytes(), {"x": (1, 3, 48, 192)}),
    "cls-b8": (lambda: rapidocr_model(CLS).read_bytes(), {"x": (8, 3, 48, 192)}),
    "rec-b1": (lambda: rapidocr_model(REC).read_bytes(), {"x": (1, 3, 48, 320)}),
    "rec-b4": (lambda: rapidocr_model(REC).read_bytes(), {"x": (4, 3, 48, 320)}),
    "det-320": (lambda: rapidocr_model(DET).read_bytes(), {"x": (1, 3, 320, 320)}),
    "encoder": (bert_encoder_model, {"x": (1, 128, 256)}),
    "residual": (convnets.residual_model, {"x": (2, 3, 64, 64)}),
    "mobile": (convnets.mobile_model, {"x": (2, 3, 64, 64)}),
    "branches": (convnets.branches_model, {"x": (1, 3, 64, 64)}),
    "convnext": (convnets.convnext_model, {"x": (1, 3, 64, 64)}),
}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return KernelStore(tmp_path_factory.mktemp("cuda-store"))


@pytest.mark.parametrize("case", sorted(CASES))
def test_cuda_kernel_verifies_and_answers_like_onnx_runtime(case, store):
    build_model, bucket = CASES[case]
    model = load_model(build_model(), max_bytes=64 << 20)
    outcome = compile_bucket(model, bucket, resolve_target("cuda", cuda_arch="sm_90"), store)
    assert outcome.manifest.target["kind"] == "cuda"
    assert outcome.manifest.verified is True, outcome.manifest.verification

    # A fresh input, run by the loaded kernel on the GPU and by ONNX Runtime.
    weights = load_weights(store.prepared_path(model.digest))
    names = model.signature
    kernel = TvmEngine(
        outcome.library_path,
        names.input_names,
        names.output_names,
        device="cuda",
        weights=[weights[name] for name in outcome.manifest.weights],
    )
    inputs = random_inputs(bucket, {"x": "float32"}, 11)
    expected = OrtEngine(model.data, cuda=True).run(inputs)
    answered = kernel.run(inputs)
    assert set(answered) == set(expected)
    for name, want in expected.items():
        assert answered[name].shape == want.shape
        np.testing.assert_allclose(answered[name], want, rtol=1e-3, atol=1e-3)


def test_an_f16_kernel_on_tensor_cores_verifies_within_its_budget(store):
    """The encoder's projections on float16 tensor cores (float32 sums) answer within an f16 contract's
    cosine 0.999 of ONNX Runtime's fp32."""
    from compiler.building.options import CompileOptions
    from compiler.running.precision import AccuracyBudget

    model = load_model(bert_encoder_model(), max_bytes=64 << 20)
    options = CompileOptions(precision="f16", budget=AccuracyBudget(cosine=0.999))
    outcome = compile_bucket(model, {"x": (1, 128, 256)}, resolve_target("cuda", cuda_arch="sm_90"), store, options)
    assert outcome.manifest.verified is True, outcome.manifest.verification
    assert outcome.manifest.options.get("precision") == "f16"


@pytest.mark.parametrize("case", ["encoder", "residual"])
def test_a_cuda_graph_kernel_replays_with_each_call_s_input(case, store):
    """Captured at its first call, the graphs replay at later ones on the new inputs: the answers equal the
    plain kernel's, input after input (a stale capture would answer the first input again)."""
    from compiler.building.options import CompileOptions

    build_model, bucket = CASES[case]
    model = load_model(build_model(), max_bytes=64 << 20)
    target = resolve_target("cuda", cuda_arch="sm_90")
    kernels = []
    for options in (CompileOptions(), CompileOptions(cuda_graph=True)):
        outcome = compile_bucket(model, bucket, target, store, options)
        assert outcome.manifest.verified is True, outcome.manifest.verification
        kernels.append(open_kernel(model, outcome, store, "cuda"))
    assert outcome.manifest.cuda_graph["graphs"] >= 1, outcome.manifest.cuda_graph
    plain, graphed = kernels
    for seed in (21, 22, 23):
        inputs = random_inputs(bucket, {"x": "float32"}, seed)
        want, got = plain.run(inputs), graphed.run(inputs)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])
