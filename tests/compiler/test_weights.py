"""Weights as kernel parameters: kernels keyed by the graph, weights prepared once per model version."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from compiler.building.build import compile_bucket, open_kernel
from compiler.building.target import resolve_target
from compiler.models import weights as weights_module
from compiler.models.model import load_model
from compiler.models.weights import graph_digest, load_weights, weight_bytes
from compiler.running.engines import OrtEngine
from compiler.storage.store import KernelStore
from tests import synthetic

BERT = {"layers": 1, "hidden": 64, "heads": 4, "seq": 16}


def _load(data: bytes):
    return load_model(data, max_bytes=len(data))


def test_graph_digest_ignores_weight_values_and_nothing_else():
    data = synthetic.bert_encoder_model(**BERT)
    model = onnx.load_from_string(data)
    assert graph_digest(model) == graph_digest(onnx.load_from_string(synthetic.reweighted(data, 1)))
    assert weight_bytes(model) > 0
    # A small constant (the scores' scale) is baked into the kernel: its value counts.
    scaled = onnx.load_from_string(data)
    scale = next(t for t in scaled.graph.initializer if t.name == "scale")
    scale.CopyFrom(onnx.numpy_helper.from_array(np.array(3.0, np.float32), "scale"))
    assert graph_digest(scaled) != graph_digest(model)
    # So does a weight's shape.
    wider = onnx.load_from_string(synthetic.bert_encoder_model(**(BERT | {"hidden": 128})))
    assert graph_digest(wider) != graph_digest(model)


@pytest.mark.parametrize(
    ("data", "shape"),
    [
        (synthetic.bert_encoder_model(**BERT), (2, 16, 64)),
        (synthetic.conv_bn_model(channels=64, size=16), (1, 3, 16, 16)),
    ],
    ids=["encoder", "conv"],
)
def test_new_weights_reuse_the_kernel_and_run_with_their_own_weights(tmp_path, data, shape):
    store = KernelStore(tmp_path)
    target = resolve_target("llvm")
    first_model, second_data = _load(data), synthetic.reweighted(data, 7)
    second_model = _load(second_data)
    assert first_model.digest != second_model.digest

    first = compile_bucket(first_model, {"x": shape}, target, store)
    assert first.manifest.verified is True, first.manifest.verification
    assert first.manifest.weights, "the kernel takes the weights as parameters"
    second = compile_bucket(second_model, {"x": shape}, target, store)
    assert second.cached and second.manifest.key == first.manifest.key  # 0 compiles

    # Weights are stored once per version, never inside the kernel.
    library = Path(first.library_path).read_bytes()
    for digest in (first_model.digest, second_model.digest):
        weights = load_weights(store.prepared_path(digest))
        largest = max(weights.values(), key=lambda array: array.nbytes)
        assert largest.tobytes()[:256] not in library
    x = {"x": np.random.default_rng(3).standard_normal(shape).astype(np.float32)}
    for model, raw in ((first_model, data), (second_model, second_data)):
        got = open_kernel(model, first, store).run(x)
        want = OrtEngine(raw).run(x)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-3, atol=1e-4)
    first_out = open_kernel(first_model, first, store).run(x)
    second_out = open_kernel(second_model, first, store).run(x)
    assert not np.allclose(next(iter(first_out.values())), next(iter(second_out.values())))


def test_a_kernel_records_the_workspace_it_keeps_and_a_bigger_bucket_keeps_more(tmp_path):
    """Measured in the compile child: what a loaded kernel holds beyond its code and the weights (the
    kernel cache's byte cap counts it)."""
    store = KernelStore(tmp_path)
    model = _load(synthetic.bert_encoder_model(layers=1, hidden=128, heads=4, seq=64))
    small, large = (compile_bucket(model, {"x": (n, 64, 128)}, resolve_target("llvm"), store).manifest for n in (1, 16))
    assert small.verified and large.verified
    # Batch 16's intermediates alone (16x64x512 floats in the FFN, 16x4x64x64 attention scores) pass 2 MiB.
    assert large.workspace_bytes > 2 * 2**20 > small.workspace_bytes >= 0


def test_a_weight_whose_data_disagrees_with_its_dims_is_refused():
    """The checker sees the weightless graph; the weights' data is checked against their dims apart."""
    from compiler.errors import InvalidModelError

    model = onnx.load_from_string(synthetic.bert_encoder_model(**BERT))
    weight = next(t for t in model.graph.initializer if weights_module.is_weight(t))
    weight.raw_data = weight.raw_data[:-4]  # one float short
    with pytest.raises(InvalidModelError, match=rf"initializer '{weight.name}' holds .* need"):
        _load(model.SerializeToString())


def test_the_weightless_model_has_every_weight_as_a_typed_input_and_no_weight_bytes():
    model = onnx.load_from_string(synthetic.bert_encoder_model(**BERT))
    light = weights_module.weightless(model)
    names = {t.name for t in model.graph.initializer if weights_module.is_weight(t)}
    assert names and names <= {value.name for value in light.graph.input}
    assert not names & {t.name for t in light.graph.initializer}
    assert light.ByteSize() < model.ByteSize() / 10
    onnx.checker.check_model(light, full_check=True)
    assert [n.op_type for n in light.graph.node] == [n.op_type for n in model.graph.node]
