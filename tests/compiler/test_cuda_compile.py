"""CUDA compiles that need no GPU: the schedules every kernel gets, and the math its source is compiled with."""

from __future__ import annotations

import shutil

import pytest
import tvm
import tvm_ffi
from tvm.script import tirx as T
from tvm.support import nvcc

from compiler.building.build import compile_bucket
from compiler.building.cuda_math import compile_cuda_exactly, use_exact_cuda_math
from compiler.building.target import resolve_target
from compiler.models.model import load_model
from compiler.storage.store import KernelStore
from tests import convnets

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA's compiler; no GPU)")


@T.prim_func
def _square(a: T.Buffer((64,), "float32"), b: T.Buffer((64,), "float32")):
    for i in T.thread_binding(64, "threadIdx.x"):
        b[i] = T.pow(a[i], T.float32(2))


@pytest.fixture(scope="module")
def square_source() -> str:
    return tvm.compile(_square, target=CUDA).mod.imports[0].inspect_source()


@needs_nvcc
def test_cuda_source_is_compiled_without_fast_math(square_source):
    """TVM's own callback compiles with --use_fast_math: powf becomes exp2(2 * log2(x)), NaN for every
    negative x (a layer norm's squared deviations). The callback jitserve registers keeps powf exact."""
    with CUDA:
        fast = bytes(nvcc.compile_cuda(square_source, target_format="ptx", compiler="nvcc")).decode()
        exact = compile_cuda_exactly(square_source, "ptx").decode()
        use_exact_cuda_math()
        registered = bytes(tvm_ffi.get_global_func("tvm_callback_cuda_compile")(square_source, "ptx")).decode()
    assert "lg2.approx" in fast
    assert "lg2.approx" not in exact
    assert registered == exact


def test_a_dlight_rule_that_fails_on_a_kernel_declines_it(tmp_path):
    """dlight's GPU Matmul asserts on a conv whose fused epilogue (hardswish, SiLU) it cannot inline;
    the next rule schedules that kernel and the model builds."""
    model = load_model(convnets.mobile_model(), max_bytes=1 << 20)
    outcome = compile_bucket(model, {"x": (2, 3, 64, 64)}, resolve_target("cuda"), KernelStore(tmp_path))
    assert outcome.manifest.library_bytes > 0
    assert None not in outcome.manifest.schedules.values()
