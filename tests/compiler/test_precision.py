"""The precision contract: an accuracy budget that holds or breaks on real reduced-precision answers
(OpenVINO with its weights stored in fp16; bf16 and f16 arithmetic where the CPU has them), the
budget's bounds one by one, and reduced precisions a CPU cannot run refused with the reason."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
from pydantic import ValidationError

from compiler.errors import CompileError
from compiler.running.engines import OrtEngine
from compiler.running.openvino_engine import OpenVinoEngine, missing_precision, openvino_capabilities, verify_openvino
from compiler.running.precision import (
    AccuracyBudget,
    PrecisionContract,
    budget_for,
    compare_within_budget,
    reduced_precision,
)
from tests import convnets

pytest.importorskip("openvino")

BUCKET = {"x": (2, 3, 56, 56)}


def test_a_budget_needs_a_bound_and_a_contract_a_known_precision():
    with pytest.raises(ValidationError, match="at least one of atol, rtol, cosine, top_k"):
        AccuracyBudget()
    with pytest.raises(ValidationError):
        PrecisionContract(allow=["int4"], budget={"cosine": 0.99})
    with pytest.raises(ValidationError):
        PrecisionContract(allow=[], budget={"cosine": 0.99})
    assert PrecisionContract(allow=["bf16"], budget={"top_k": 5}).budget.top_k == 5
    assert [reduced_precision(e) for e in ("openvino", "openvino-bf16", "openvino-f16-weights", "tvm")] == [
        None, "bf16", "f16-weights", None
    ]  # fmt: skip
    contract = PrecisionContract(allow=["bf16"], budget={"cosine": 0.99})
    assert budget_for("openvino-bf16", contract, quantized=False) is contract.budget
    assert budget_for("openvino", contract, quantized=True) is None  # int8 not allowed: one step it is
    assert budget_for("openvino-bf16", None, quantized=False) is None
    int8 = PrecisionContract(allow=["int8"], budget={"cosine": 0.98})
    assert budget_for("openvino", int8, quantized=True) is int8.budget
    assert budget_for("openvino", int8, quantized=False) is None  # a float model: fp32-exact
    assert budget_for("onnxruntime", int8, quantized=True) is None


def test_each_bound_of_the_budget():
    rng = np.random.default_rng(0)
    want = {"logits": rng.standard_normal((4, 10)).astype(np.float32)}
    near = {"logits": want["logits"] + np.float32(1e-3)}
    assert compare_within_budget(near, want, AccuracyBudget(atol=2e-3)).matches
    assert not compare_within_budget(near, want, AccuracyBudget(atol=1e-4)).matches
    assert compare_within_budget(near, want, AccuracyBudget(cosine=0.9999)).matches
    flipped = {"logits": -want["logits"]}
    result = compare_within_budget(flipped, want, AccuracyBudget(cosine=0.5))
    assert not result.matches and "cosine similarity -1.000000" in result.detail
    # The runner-up promoted to first: within the top 2, outside the top 1.
    order = np.argsort(-want["logits"], axis=1)
    swapped = want["logits"].copy()
    rows = np.arange(4)
    swapped[rows, order[:, 1]] = want["logits"][rows, order[:, 0]] + 1
    assert compare_within_budget({"logits": swapped}, want, AccuracyBudget(top_k=2)).matches
    top1 = compare_within_budget({"logits": swapped}, want, AccuracyBudget(top_k=1))
    assert not top1.matches and "outside onnxruntime's top 1 on 100.00% of rows" in top1.detail
    nan = {"logits": want["logits"].copy()}
    nan["logits"][0, 0] = np.nan
    assert not compare_within_budget(nan, want, AccuracyBudget(atol=1.0)).matches


def test_fp16_weights_stray_past_fp32_verification_and_keep_a_loose_budget_not_a_tight_one(tmp_path):
    data = convnets.residual_model()
    reference = OrtEngine(data)
    engine = OpenVinoEngine.static(data, BUCKET, ["y"], ir_dir=tmp_path / "ir", precision="f16-weights")
    assert engine.name == "openvino-f16-weights"

    def verify(**kwargs):
        return verify_openvino(engine, reference, BUCKET, {"x": "float32"}, rtol=1e-5, atol=1e-6, seed=0, **kwargs)

    assert not verify()[0]  # fp16-rounded weights: no longer fp32-exact
    loose, detail = verify(
        compare=partial(compare_within_budget, budget=AccuracyBudget(cosine=0.999, rtol=0.05, atol=0.05))
    )
    assert loose, detail
    assert detail.startswith("within budget (") and "cosine" in detail
    tight, detail = verify(compare=partial(compare_within_budget, budget=AccuracyBudget(atol=1e-6)))
    assert not tight and "beyond atol 1e-06" in detail
    with pytest.raises(CompileError, match="its own format"):
        OpenVinoEngine.static(data, BUCKET, ["y"], precision="f16-weights")


@pytest.mark.parametrize("precision", ["bf16", "f16"])
def test_a_reduced_arithmetic_runs_only_where_the_cpu_has_it(tmp_path, precision):
    capability = {"bf16": "BF16", "f16": "FP16"}[precision]
    data = convnets.residual_model()
    if capability in openvino_capabilities():
        assert missing_precision(precision) is None
        engine = OpenVinoEngine.static(data, BUCKET, ["y"], ir_dir=tmp_path / "ir", precision=precision)
        assert engine.name == f"openvino-{precision}"
        # The arithmetic really is reduced (the answers move off fp32's), and stays within a budget.
        image = {"x": np.random.default_rng(1).standard_normal(BUCKET["x"]).astype(np.float32)}
        got, want = engine.run(image)["y"], OrtEngine(data).run(image)["y"]
        assert np.abs(got - want).max() > 1e-4
        result = compare_within_budget({"y": got}, {"y": want}, AccuracyBudget(cosine=0.999))
        assert result.matches, result.detail
    else:
        assert f"{precision} needs a CPU with it" in missing_precision(precision)
        with pytest.raises(CompileError, match=f"{precision} needs a CPU with it"):
            OpenVinoEngine.static(data, BUCKET, ["y"], ir_dir=tmp_path / "ir", precision=precision)
