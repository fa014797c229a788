"""CUDA compiles that need no GPU: the schedules every kernel gets, and the math its source is compiled with."""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

import onnx
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
from compiler.tvm.build import compile_relax, import_relax
from tests import convnets
from tests.synthetic import bert_encoder_model

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


_KERNEL_DEFINITION = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)_kernel\([^;{]*\)\s*\{')


def _kernel_sources(source: str) -> dict[str, str]:
    """Each ``__global__`` kernel's CUDA source (its definition, up to the next one) by name."""
    found = list(_KERNEL_DEFINITION.finditer(source))
    ends = [match.start() for match in found[1:]] + [len(source)]
    return {match.group(1): source[match.start() : end] for match, end in zip(found, ends, strict=True)}


def _encoder_cuda_source(precision: str) -> tuple[str, dict]:
    model = onnx.load_from_string(bert_encoder_model(layers=1, hidden=256, heads=4, seq=128))
    mod = import_relax(model, {"x": (1, 128, 256)}, {"x": "float32"})
    observed: dict = {}
    executable = compile_relax(mod, {"kind": "cuda", "arch": "sm_90"}, observed=observed, precision=precision)
    cuda = [module for module in _modules(executable.mod) if module.kind == "cuda"]
    return cuda[0].inspect_source(), observed["schedules"]


def _modules(module):
    yield module
    for imported in module.imports:
        yield from _modules(imported)


@pytest.fixture(scope="module")
def f16_encoder() -> tuple[str, dict]:
    return _encoder_cuda_source("f16")


def test_an_f16_compile_runs_the_large_matmuls_on_tensor_cores(f16_encoder):
    """Under an f16 contract the encoder's projections (128 rows, 256 to 1024 wide) are float16 products
    with float32 sums on wmma fragments; its attention products (64 deep) stay float32, as does all else."""
    source, schedules = f16_encoder
    kernels = _kernel_sources(source)
    on_tensor_cores = {name for name, code in kernels.items() if "wmma::mma_sync" in code}
    projections = {name for name in schedules if name.startswith("fused_matmul")}
    assert len(projections) == 5, schedules
    assert {name for name in on_tensor_cores if name.startswith("fused_matmul")} == projections
    assert on_tensor_cores <= projections, on_tensor_cores - projections
    for name in on_tensor_cores:
        assert "wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float>" in kernels[name]


def test_an_fp32_compile_uses_no_tensor_core():
    source, _ = _encoder_cuda_source("fp32")
    assert "wmma" not in source


@needs_nvcc
def test_the_tensor_core_kernels_compile_to_mma_instructions_for_sm_90(f16_encoder):
    source, _ = f16_encoder
    with CUDA:
        ptx = compile_cuda_exactly(source, "ptx").decode()
    assert "wmma.mma.sync.aligned" in ptx and ".f16" in ptx


def test_a_cuda_graph_compile_is_keyed_apart_and_says_what_it_captured():
    from compiler.building.options import CompileOptions

    model = load_model(bert_encoder_model(layers=2, hidden=256, heads=4, seq=128), max_bytes=64 << 20)
    target = resolve_target("cuda", cuda_arch="sm_90")
    store = KernelStore(Path(tempfile.mkdtemp()))
    plain = compile_bucket(model, {"x": (1, 128, 256)}, target, store).manifest
    graphed = compile_bucket(model, {"x": (1, 128, 256)}, target, store, CompileOptions(cuda_graph=True)).manifest
    assert plain.cuda_graph is None and "cuda_graph" not in plain.options
    assert graphed.key != plain.key and graphed.options["cuda_graph"] is True
    assert graphed.cuda_graph["graphs"] == 1 and graphed.cuda_graph["launched_alone"] == 2, graphed.cuda_graph
    assert graphed.schedules["stage_input"] is not None  # the copy is scheduled like any kernel


def _lowered_graph_facts(mod, **options) -> dict:
    from compiler.tvm.cuda_graphs import graph_facts

    stages = {}
    compile_relax(mod, {"kind": "cuda", "arch": "sm_90"}, snapshot=stages.__setitem__, **options)
    return graph_facts(stages["lower"])


def test_a_cuda_graph_holds_every_kernel_but_the_input_copy_and_the_output():
    """Staged, the encoder's kernels (the projections reading the input among them) are one graph: a copy of
    the input and the kernel writing the returned tensor launch alone. TVM's rewrite alone leaves each kernel
    that reads the call's input (a fresh tensor per call) outside, and splits the graphs around them."""
    model = onnx.load_from_string(bert_encoder_model(layers=1, hidden=256, heads=4, seq=128))
    mod = import_relax(model, {"x": (1, 128, 256)}, {"x": "float32"})
    plain = _lowered_graph_facts(mod)
    staged = _lowered_graph_facts(mod, cuda_graph=True)
    unstaged_pass = tvm.transform.module_pass(lambda module, _ctx: module, opt_level=0, name="unstaged")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("compiler.tvm.pipeline.stage_inputs_pass", unstaged_pass)
        unstaged = _lowered_graph_facts(mod, cuda_graph=True)
    assert plain["graphs"] == 0 and plain["kernels_in_graphs"] == 0
    assert staged == {"graphs": 1, "kernels_in_graphs": plain["launched_alone"] - 1, "launched_alone": 2}
    # Q, K and V projections, the residual, and the output's kernel
    assert unstaged["launched_alone"] == 5 and unstaged["graphs"] > 1, unstaged


def test_cuda_graphs_are_refused_off_cuda():
    from compiler.errors import CompileError

    mod = import_relax(onnx.load_from_string(bert_encoder_model(layers=1)), {"x": (1, 128, 256)}, {"x": "float32"})
    with pytest.raises(CompileError, match="CUDA graphs are for the cuda target, not llvm"):
        compile_relax(mod, {"kind": "llvm"}, cuda_graph=True)
