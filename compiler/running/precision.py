"""A model owner's precision contract: which reduced precisions may serve the model, and the accuracy
budget each such engine must keep against fp32 ONNX Runtime.

Without a contract only fp32-exact engines serve (verified at the compile tolerances). With one, an
engine in reduced precision is verified against fp32 ONNX Runtime within the budget on every bucket
before it may be routed to, and again on served requests by the shadow checks.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from .arrays import Comparison

ReducedPrecision = Literal["bf16", "f16", "f16-weights", "int8"]
"""``bf16`` and ``f16``: arithmetic in that type (where the CPU has it: AMX, AVX512-BF16, AVX512-FP16);
``f16-weights``: weights stored in fp16, arithmetic in fp32 (any CPU); ``int8``: a quantized model's
integer arithmetic on another engine than ONNX Runtime, whose roundings compound differently through a
deep network (ResNet-50 QDQ: OpenVINO and ONNX Runtime int8 each at cosine 0.98 to the fp32 model, and
0.987 to each other: 25 quantization steps apart on some logits)."""


def reduced_precision(engine: str) -> str | None:
    """The reduced precision an engine runs in, by its name (``openvino-bf16``: bf16); None for fp32."""
    return next((p for p in ("f16-weights", "bf16", "f16") if engine.endswith(f"-{p}")), None)


def budget_for(engine: str, contract: PrecisionContract | None, quantized: bool) -> AccuracyBudget | None:
    """The budget ``engine`` is judged by against ONNX Runtime: the contract's for a reduced-precision
    engine, and for any engine but ONNX Runtime on a quantized model whose contract allows ``int8``; None
    (the verification tolerances) otherwise."""
    if contract is None or engine == "onnxruntime":
        return None
    if reduced_precision(engine) or (quantized and "int8" in contract.allow):
        return contract.budget
    return None


class AccuracyBudget(BaseModel):
    """How far a reduced-precision engine may stray from fp32 ONNX Runtime, on every output; every bound
    given must hold."""

    model_config = ConfigDict(extra="forbid")

    atol: float | None = Field(None, ge=0, allow_inf_nan=False, description="absolute tolerance (with rtol)")
    rtol: float | None = Field(None, ge=0, allow_inf_nan=False, description="relative tolerance (with atol)")
    cosine: float | None = Field(
        None, gt=0, le=1, allow_inf_nan=False, description="least cosine similarity of each output to onnxruntime's"
    )
    top_k: int | None = Field(
        None, ge=1, description="classifier outputs: each row's top class (last axis) is among onnxruntime's top k"
    )

    @model_validator(mode="after")
    def _some_bound(self) -> AccuracyBudget:
        if self.atol is None and self.rtol is None and self.cosine is None and self.top_k is None:
            raise ValueError("an accuracy budget needs at least one of atol, rtol, cosine, top_k")
        return self


class PrecisionContract(BaseModel):
    """Reduced precisions the owner allows, and the budget each must keep."""

    model_config = ConfigDict(extra="forbid")

    allow: list[ReducedPrecision] = Field(min_length=1, description="reduced precisions that may serve")
    budget: AccuracyBudget


def compare_within_budget(
    actual: dict[str, np.ndarray], expected: dict[str, np.ndarray], budget: AccuracyBudget
) -> Comparison:
    """Whether every output keeps the budget, its largest difference, and what was measured."""
    worst_error, worst_name, problems, measured = 0.0, None, [], []
    for name, want in expected.items():
        got = actual.get(name)
        if got is None or got.shape != want.shape:
            problems.append(f"output {name!r} missing or of shape {None if got is None else got.shape}")
            continue
        got64, want64 = got.astype(np.float64), want.astype(np.float64)
        if not (np.isfinite(got64).all() and np.isfinite(want64).all()):
            if not np.array_equal(got64, want64, equal_nan=True):
                problems.append(f"output {name!r} has NaN or infinity where onnxruntime differs")
            continue
        error = float(np.max(np.abs(got64 - want64), initial=0.0))
        if error >= worst_error:
            worst_error, worst_name = error, name
        facts, broken = _bounds(got64, want64, budget)
        measured.append(f"{name!r}: max abs error {error:.3g}{facts}")
        problems += [f"output {name!r} {problem}" for problem in broken]
    detail = "; ".join(problems) if problems else "within budget"
    return Comparison(not problems, worst_error, worst_name, f"{detail} ({', '.join(measured)})")


def _bounds(got: np.ndarray, want: np.ndarray, budget: AccuracyBudget) -> tuple[str, list[str]]:
    facts, broken = "", []
    if budget.atol is not None or budget.rtol is not None:
        atol, rtol = budget.atol or 0.0, budget.rtol or 0.0
        if not np.allclose(got, want, rtol=rtol, atol=atol):
            broken.append(f"beyond atol {atol:g} and rtol {rtol:g}")
    if budget.cosine is not None:
        norms = float(np.linalg.norm(got) * np.linalg.norm(want))
        cosine = float(np.dot(got.ravel(), want.ravel()) / norms) if norms else float(np.array_equal(got, want))
        facts += f", cosine {cosine:.6f}"
        if cosine < budget.cosine:
            broken.append(f"has cosine similarity {cosine:.6f}, under {budget.cosine:g}")
    if budget.top_k is not None and got.ndim >= 1 and got.shape[-1]:
        rows_got, rows_want = got.reshape(-1, got.shape[-1]), want.reshape(-1, want.shape[-1])
        k = min(budget.top_k, rows_want.shape[1])
        top = np.argsort(-rows_want, axis=1, kind="stable")[:, :k]
        agree = float(np.mean([row.argmax() in best for row, best in zip(rows_got, top, strict=True)]))
        facts += f", top-1 among onnxruntime's top-{k} on {agree:.2%} of rows"
        if agree < 1.0:
            broken.append(f"top class outside onnxruntime's top {k} on {1 - agree:.2%} of rows")
    return facts, broken
