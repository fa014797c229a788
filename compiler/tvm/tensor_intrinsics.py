"""TVM's registered tensor intrinsics, imported for the target's family only, and quickly.

Runs in the compile child only (imports TVM).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import linecache
import platform
import sys
import types
from collections.abc import Iterator

TENSOR_INTRINSICS = "tvm.s_tir.tensor_intrin"


def intrinsic_families(target_dict: dict) -> tuple[str, ...] | None:
    """The tensor-intrinsic modules MetaSchedule's rules may name for this target; None when unknown."""
    kind = target_dict.get("kind")
    if kind == "cuda":
        return ("cuda", "dot_product_common")
    if kind != "llvm":
        return None
    # An llvm target without a triple compiles for this host.
    arch = str(target_dict.get("mtriple") or platform.machine()).split("-")[0]
    if arch in ("x86_64", "amd64", "i686"):
        return ("x86",)
    if arch.startswith(("aarch64", "arm")):
        return ("arm_cpu",)
    return ("riscv_cpu",) if arch.startswith("riscv") else None


def register_tensor_intrinsics(target_dict: dict) -> None:
    """Register only the target's tensor intrinsics before a TuneContext imports them all.

    TuneContext imports tvm.s_tir.tensor_intrin, whose package parses every family's TVMScript
    (CUDA, ROCm, Arm, Hexagon): 40 s of every tuning run on 2 cores, against 0.4 s for the x86
    ones alone. A bare package module in its place makes that import a no-op; the target's own
    family is then imported into it (also where an earlier tuning run in this process left the bare
    package for another family), so each rule still finds the intrinsics it names."""
    families = intrinsic_families(target_dict)
    if families is None:
        with _frames_without_source_lookup():
            importlib.import_module(TENSOR_INTRINSICS)
        return
    if TENSOR_INTRINSICS not in sys.modules:
        spec = importlib.util.find_spec(TENSOR_INTRINSICS)
        package = types.ModuleType(TENSOR_INTRINSICS, "Tensor intrinsics of the tuning targets' families only.")
        package.__path__ = list(spec.submodule_search_locations)
        package.__package__ = TENSOR_INTRINSICS
        sys.modules[TENSOR_INTRINSICS] = package
    with _frames_without_source_lookup():
        for family in families:
            importlib.import_module(f"{TENSOR_INTRINSICS}.{family}")


@contextlib.contextmanager
def _frames_without_source_lookup() -> Iterator[None]:
    """``inspect.stack`` without its per-frame source lookup, while TVMScript parses a family's intrinsics.

    Every ``@T.prim_func`` calls ``inspect.stack()`` (for the caller's locals and context line), and the
    stack's frames in ``<frozen importlib...>``, whose files do not exist, each send ``inspect`` through a
    scan of every loaded module: CUDA's 248 intrinsics took 41 s to import into a compile child, 60 s from
    within a compile's schedule stage (deeper stacks), on 2 cores. The frames, names, line numbers and
    context lines are the same, read from the line cache."""
    original = inspect.stack

    def stack(context: int = 1) -> list[inspect.FrameInfo]:
        frames, frame = [], sys._getframe(1)
        while frame is not None:
            code = frame.f_code
            line = linecache.getline(code.co_filename, frame.f_lineno) if context else ""
            lines = [line] if line else None
            frames.append(
                inspect.FrameInfo(frame, code.co_filename, frame.f_lineno, code.co_name, lines, 0 if lines else None)
            )
            frame = frame.f_back
        return frames

    inspect.stack = stack
    try:
        yield
    finally:
        inspect.stack = original
