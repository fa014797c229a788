"""The attention path of a GPT-2-style decoder (``tests/synthetic.py``: ``causal_decoder_model``) compiled
and checked against ONNX Runtime: token and position embeddings, the causal mask computed from the
sequence's length, the scaled scores, Softmax, GELU's tanh form, layer norms and a head of 97 columns, in
static buckets and in the dynamic tier, whose sequence axis stays symbolic."""

from __future__ import annotations

import numpy as np
import pytest

from compiler.building.build import compile_bucket, open_kernel
from compiler.building.target import resolve_target
from compiler.models.model import load_model
from compiler.running.engines import OrtEngine
from compiler.storage.store import KernelStore
from tests import synthetic

pytest.importorskip("tvm")

TARGET = resolve_target("llvm")


@pytest.fixture(scope="module")
def decoder() -> bytes:
    return synthetic.causal_decoder_model()


def test_a_causal_decoders_buckets_verify_with_every_kernel_scheduled(tmp_path, decoder):
    model, store = load_model(decoder, max_bytes=1 << 24), KernelStore(tmp_path)
    for bucket in ({"ids": (1, 16)}, {"ids": (2, 8)}):
        manifest = compile_bucket(model, bucket, TARGET, store).manifest
        assert manifest.verified, manifest.verification
        assert manifest.unscheduled == [], manifest.schedules
        # The scores with their scale and mask are one batch-matmul kernel; Softmax and the norms are rows.
        masked = [name for name in manifest.schedules if "matmul" in name and "where" in name]
        assert [manifest.schedules[name] for name in masked] == ["Contraction"], manifest.schedules
        assert manifest.schedules["softmax"] == manifest.schedules["layer_norm"] == "RowReduction"


def test_one_dynamic_kernel_serves_every_sequence_length_of_a_causal_decoder(tmp_path, decoder):
    """The positions are ``Range(0, seq)`` and the mask compares them: TVM's importer computed that range's
    length as a tensor, so no shape after it was known and the import failed; GPT-2's ``Reshape`` of
    ``seq + 1`` to one element failed too (compiler/tvm/onnx_import.py)."""
    model, store = load_model(decoder, max_bytes=1 << 24), KernelStore(tmp_path)
    outcome = compile_bucket(model, {"ids": (1, "seq")}, TARGET, store, verify_sizes={"seq": [5, 16, 33]})
    assert outcome.manifest.verified, outcome.manifest.verification
    assert outcome.manifest.unscheduled == [], outcome.manifest.schedules
    kernel, reference = open_kernel(model, outcome, store), OrtEngine(decoder)
    for length in (2, 24, 61):  # lengths it was not verified at
        ids = {"ids": np.random.default_rng(length).integers(0, 97, (1, length)).astype(np.int64)}
        got, want = kernel.run(ids)["logits"], reference.run(ids)["logits"]
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)
    # Causal: a later token changes no earlier position's logits.
    ids = np.random.default_rng(3).integers(0, 97, (1, 12)).astype(np.int64)
    before = kernel.run({"ids": ids})["logits"]
    ids[0, 8] = (ids[0, 8] + 1) % 97
    after = kernel.run({"ids": ids})["logits"]
    np.testing.assert_array_equal(before[0, :8], after[0, :8])
    assert not np.allclose(before[0, 8:], after[0, 8:])
