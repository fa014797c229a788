"""The lifted weight transform, one function per transformed weight: buckets of one model version share
every transformed weight they read in the same layout, and compute only what is their own."""

from __future__ import annotations

import numpy as np
import pytest

from compiler.building.build import compile_bucket
from compiler.building.target import resolve_target
from compiler.errors import CompileError
from compiler.models.model import load_model
from compiler.running.engines import OrtEngine
from compiler.storage.store import KernelStore
from tests import synthetic

pytest.importorskip("tvm")

from server.runtime.memory.kernel_cache import WeightPool, open_tvm_engine

TARGET = resolve_target("llvm")
# A decoder whose position embeddings are gathered for the bucket's length (weight-only, so lifted into the
# transform, and of the bucket's shape), beside matmuls whose weights are packed in panels (the bucket's
# rows play no part in their layout). Buckets differ in batch and in length.
BUCKETS = [{"ids": (1, 8)}, {"ids": (2, 16)}]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    data = synthetic.causal_decoder_model()
    model = load_model(data, max_bytes=1 << 24)
    store = KernelStore(tmp_path_factory.mktemp("store"))
    manifests = [compile_bucket(model, bucket, TARGET, store).manifest for bucket in BUCKETS]
    assert all(manifest.verified for manifest in manifests), [m.verification for m in manifests]
    return data, model, store, manifests


def test_buckets_of_other_shapes_agree_on_every_transformed_weight_but_their_own(compiled):
    _, _, _, manifests = compiled
    first, second = ([fact["digest"] for fact in m.weight_outputs] for m in manifests)
    assert len(first) == len(second)
    differing = [i for i, (a, b) in enumerate(zip(first, second, strict=True)) if a != b]
    # What is the bucket's own: the position embeddings gathered for its length, and what is of its shape.
    sizes = [manifests[0].weight_outputs[i]["bytes"] for i in differing]
    assert differing and max(sizes) <= 8 * 64 * 4, sizes
    shared = [fact["bytes"] for i, fact in enumerate(manifests[0].weight_outputs) if i not in differing]
    assert sum(shared) > 10 * sum(sizes)  # the panels: most of what the transform computes


def test_a_further_bucket_computes_only_its_own_weights_and_each_answers_right(compiled):
    data, model, store, manifests = compiled
    pool = WeightPool(store)
    reference = OrtEngine(data)
    engines, transformed = [], []
    for manifest in manifests:
        weights = pool.get(model.digest, "llvm").for_kernel(manifest)
        engines.append(open_tvm_engine(store.library_path(manifest.key), model.signature, TARGET, weights))
        del weights
        transformed.append(pool.find(model.digest, "llvm").transformed.nbytes)
        ids = np.random.default_rng(3).integers(0, 97, manifest.bucket["ids"])
        want = reference.run({"ids": ids})["logits"]
        np.testing.assert_allclose(engines[-1].run({"ids": ids})["logits"], want, rtol=1e-3, atol=1e-4)
    own = sum(
        fact["bytes"]
        for fact, other in zip(manifests[1].weight_outputs, manifests[0].weight_outputs, strict=True)
        if fact["digest"] != other["digest"]
    )
    assert transformed[1] - transformed[0] == own  # the second bucket's own outputs, nothing it shares
    loaded = pool.find(model.digest, "llvm")
    assert loaded.describe()["transformed_bytes"] == transformed[1]
    # Each output goes with the last kernel holding it: the second bucket's own first, then the rest.
    engines.pop()
    assert loaded.transformed.nbytes == transformed[0]
    engines.pop()
    assert loaded.transformed.nbytes == 0 and loaded.transformed.count == 0


def test_a_kernel_past_the_bound_on_transformed_weights_is_refused(compiled):
    _, model, store, manifests = compiled
    pool = WeightPool(store, max_transformed_ratio=0.01)  # less than the panels of the first kernel
    with pytest.raises(CompileError, match="MAX_TRANSFORMED_WEIGHTS_RATIO"):
        pool.get(model.digest, "llvm").for_kernel(manifests[0])
