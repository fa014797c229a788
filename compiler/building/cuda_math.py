"""CUDA kernels compiled with IEEE math, never ``--use_fast_math``.

TVM turns a kernel's CUDA source into a binary through the ``tvm_callback_cuda_compile`` callback. It does
this when the module is created on a machine with a GPU, or when it is loaded there if it was built
without one. TVM's own callback passes ``--use_fast_math``, which makes ``powf`` into ``__powf``
(``exp2(y * log2(x))``). For a negative base that is NaN, even for ``x ** 2``. On an H200, PP-OCRv4 rec
squares ``x - mean`` in its layer norms, and every output came back NaN. Fast math also flushes
denormals and approximates division and square roots. Verification would refuse such kernels; with
exact math they can pass it. This callback compiles with nvcc and IEEE semantics, like the CPU kernels.
"""

from __future__ import annotations

import os
import shutil

from ..errors import CompileError

# Read by TVM's nvcc wrapper (tvm.support.nvcc) each time it builds the command line.
_NO_FAST_MATH = "TVM_CUDA_NVCC_NO_FAST_MATH"


def compile_cuda_exactly(code: str, target_format: str = "fatbin") -> bytes:
    """CUDA source -> fatbin (or ``ptx``/``cubin``) by nvcc without fast math. The architecture comes
    from the target in scope, else from the GPU."""
    from tvm.support import nvcc

    if shutil.which("nvcc") is None:
        raise CompileError("CUDA kernels are compiled by nvcc, and no nvcc is on PATH")
    os.environ[_NO_FAST_MATH] = "1"
    return bytes(nvcc.compile_cuda(code, target_format=target_format, compiler="nvcc"))


def use_exact_cuda_math() -> None:
    """Make ``compile_cuda_exactly`` this process's CUDA compile callback (idempotent)."""
    import tvm_ffi

    tvm_ffi.register_global_func("tvm_callback_cuda_compile", compile_cuda_exactly, override=True)
