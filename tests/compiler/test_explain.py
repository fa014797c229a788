"""Explain bundles: each compiled bucket's IR per pipeline stage, its kernels traced back to the ONNX
nodes they compute, and (on request) the generated code; real compiles of synthetic models."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

from compiler.building.build import compile_bucket
from compiler.building.options import CompileOptions
from compiler.building.target import resolve_target
from compiler.cli import main
from compiler.measuring.flops import model_flops
from compiler.models.model import load_model
from compiler.storage.store import EXPLAIN_DIR, KernelStore
from tests import synthetic

TARGET = resolve_target("llvm")
STAGES = {"import", "dispatch", "layout", "legalize", "fold_constants", "fuse_ops", "fuse", "schedule", "lower"}


def _bundle(outcome) -> tuple[Path, dict]:
    directory = Path(outcome.library_path).parent / EXPLAIN_DIR
    return directory, json.loads((directory / "explain.json").read_text())


@pytest.mark.parametrize(
    "model, bucket",
    [
        (synthetic.fpn_model(), {"x": (1, 4, 32, 48)}),
        (synthetic.bert_encoder_model(layers=1, hidden=64, heads=4, seq=16), {"x": (2, 16, 64)}),
    ],
    ids=["detector_neck", "encoder"],
)
def test_every_kernel_is_traced_to_the_nodes_it_computes(tmp_path, model, bucket):
    loaded = load_model(model, max_bytes=1 << 24)
    outcome = compile_bucket(loaded, bucket, TARGET, KernelStore(tmp_path))
    directory, report = _bundle(outcome)
    assert set(report["ir"]) >= STAGES, report["ir"].keys()
    for stage in STAGES:
        assert (directory / "ir" / f"{stage}.txt").stat().st_size > 0
    assert "T.vectorized" in (directory / "ir" / "schedule.txt").read_text()  # the scheduled TIR itself
    assert "T.vectorized" not in (directory / "ir" / "fuse.txt").read_text()  # each stage as it ended
    # The weight transform's functions are named, not printed: lowered, each printed the checks of every
    # weight it is handed (DenseNet-121's 429 took 21 MB each, and its compile failed out of memory).
    outputs = len(outcome.manifest.weight_outputs or [])
    assert outputs > 0 or len(bucket["x"]) == 4, "the encoder's matmuls read panels the transform packs"
    for stage in ("layout", "lower"):
        text = (directory / "ir" / f"{stage}.txt").read_text()
        assert "def main_transform_params" not in text and "def main(" in text
        assert not outputs or text.startswith(f"# {outputs} functions of the lifted weight transform"), text[:200]
    assert report["kernels"] and all(k["nodes"] for k in report["kernels"])  # every kernel has a node
    coverage = report["compute_coverage"]
    assert coverage["compute_nodes"] > 0 and coverage["in_a_kernel"] == coverage["compute_nodes"]
    assert outcome.manifest.explain_coverage == coverage
    # Nothing of the graph lost: a node not in a kernel is one the import folded (a constant).
    assert {n["op"] for n in report["not_in_a_kernel"]} <= {"Constant", "Shape", "Identity"}
    ops = {op for k in report["kernels"] for op in k["ops"]}
    assert ops >= {n["op"] for n in report["nodes"] if n not in report["not_in_a_kernel"]}
    assert report["code"] == {}  # the generated code only on request: it is a second codegen
    # Every kernel says what scheduled it, and here a default rule did each one.
    assert report["unscheduled"] == [] and outcome.manifest.unscheduled == []
    assert {k["name"]: k["schedule"] for k in report["kernels"]}.items() <= outcome.manifest.schedules.items()
    assert {k["schedule"] for k in report["kernels"]} <= {"Contraction", "RowReduction", "Injective"}


def test_a_fused_kernel_names_each_node_it_fused(tmp_path):
    loaded = load_model(synthetic.fpn_model(), max_bytes=1 << 20)
    _, report = _bundle(compile_bucket(loaded, {"x": (1, 4, 32, 48)}, TARGET, KernelStore(tmp_path)))
    kernels = {k["name"]: k for k in report["kernels"]}
    conv_relu = next(k for name, k in kernels.items() if "conv2d" in name and "relu" in name)
    assert conv_relu["ops"] == ["Conv", "Relu"]
    assert [report["nodes"][i]["op"] for i in conv_relu["nodes"]] == ["Conv", "Relu"]
    # The neck's sum: the upsampled map (Resize runs NCHW, the blocked Add beside it: ConvertLayout carries
    # no resize in a channel-blocked layout) and the Add.
    assert any("Resize" in k["ops"] for k in kernels.values()) and any("Add" in k["ops"] for k in kernels.values())


def test_the_bundle_stays_out_of_the_kernels_key(tmp_path):
    loaded = load_model(synthetic.fpn_model(), max_bytes=1 << 20)
    store = KernelStore(tmp_path)
    plain = compile_bucket(loaded, {"x": (1, 4, 32, 48)}, TARGET, store, CompileOptions(explain=False))
    assert not (Path(plain.library_path).parent / EXPLAIN_DIR).exists()
    again = compile_bucket(loaded, {"x": (1, 4, 32, 48)}, TARGET, store, CompileOptions(explain=True))
    assert again.cached and again.manifest.key == plain.manifest.key


def test_the_cli_writes_a_bundle_per_bucket_with_the_generated_code(tmp_path, capsys):
    model = tmp_path / "neck.onnx"
    model.write_bytes(synthetic.fpn_model())
    output = tmp_path / "explained"
    argv = ["explain", str(model), "--shape", "x=1,4,32,48", "--shape", "x=1,4,64,64", "-o", str(output)]
    assert main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [line["bucket"] for line in lines] == ["x=1x4x32x48", "x=1x4x64x64"]
    for line in lines:
        directory = Path(line["explain"])
        report = json.loads((directory / "explain.json").read_text())
        assert report["code"]["llvm"]["bytes"] > 0
        assembly = (directory / report["code"]["llvm"]["file"]).read_text()
        assert "vfmadd" in assembly or "fma" in assembly or "mulps" in assembly
        assert line["compute_coverage"] == {"compute_nodes": 3, "in_a_kernel": 3}
        # The profile: every conv kernel timed beside ONNX Runtime's time on the same conv, a report page.
        profile = json.loads((directory / "profile.json").read_text())
        convs = [row for row in profile["kernels"] if "conv" in row["kernel"]]
        assert convs and all(row["tvm_ms"] and row["ort_ms"] for row in convs), profile["kernels"]
        # Each conv kernel's work: its conv's multiply-adds x2 and its parameters' bytes.
        work = {kernel["name"]: kernel for kernel in report["kernels"]}
        assert all(work[row["kernel"]]["flops"] > 0 and work[row["kernel"]]["bytes"] > 0 for row in convs)
        assert (
            sum(kernel["flops"] for kernel in report["kernels"])
            == model_flops(
                onnx.load_from_string(model.read_bytes()), {"x": tuple(int(d) for d in line["bucket"][2:].split("x"))}
            )[0]
        )
        assert line["tvm_run_ms"] > 0 and line["ort_run_ms"] > 0
        for engine in ("tvm", "onnxruntime"):
            trace = json.loads((directory / "trace" / f"{engine}.json").read_text())
            assert [e for e in trace["traceEvents"] if e["ph"] == "X"]
        page = (directory / "index.html").read_text()
        assert "kernel-table" in page and convs[0]["kernel"] in page
        # Links to the bundle's own files, relative: the folder can be moved and opened anywhere.
        for stage in report["ir"].values():
            assert f"href='{stage['file']}'" in page
        assert "http" not in page.replace("http-equiv", "")


def test_profile_join_charges_folded_and_renamed_nodes_to_their_kernel():
    """ONNX Runtime's node names meet the compiled graph's: by name, by output (a blocked-layout
    ``_nchwc`` node), by the weight it reads (a MatMul that became a Gemm), or through the node that made
    a folded node's input (a BatchNormalization folded into its conv)."""
    import onnx
    from onnx import helper

    from compiler.explaining.explain_profile import _node_matcher

    source = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
            helper.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["bn"], name="bn"),
            helper.make_node("MatMul", ["bn", "wq"], ["q_mm"], name="q_mm"),
            helper.make_node("Add", ["q_mm", "bq"], ["q"], name="q"),
        ],
        "g",
        [],
        [],
        initializer=[onnx.numpy_helper.from_array(__import__("numpy").zeros(1, "float32"), n) for n in ("w", "wq")],
    )
    report = {
        "nodes": [
            {"index": 0, "op": "Conv", "name": "conv", "inputs": ["x", "w"], "outputs": ["c"]},
            {"index": 1, "op": "Gemm", "name": "Gemm_7", "inputs": ["c", "wq", "bq"], "outputs": ["_v_9"]},
        ]
    }
    node_of = _node_matcher(report, source)
    assert node_of("conv") == 0 and node_of("c_nchwc") == 0  # by name; by output, blocked layout
    assert node_of("bn") == 0  # folded into the conv: stands for the node that made its input
    assert node_of("q_mm") == 1  # the MatMul became a Gemm reading the same weight
    assert node_of("ReorderOutput_token_3") is None  # ONNX Runtime's own layout node: no ONNX node


class _RunsRecorded:
    """A loaded kernel whose plain runs are noted with the wall clock."""

    def __init__(self, engine) -> None:
        self.engine, self.runs_ns = engine, []

    def run(self, inputs):
        self.runs_ns.append(time.time_ns())
        return self.engine.run(inputs)

    def set_instrument(self, instrument) -> None:
        self.engine.set_instrument(instrument)


def test_the_profile_alternates_the_engines_run_by_run(tmp_path):
    """A machine's load shifts both engines alike only if they take turns: each timed ONNX Runtime run
    falls between two kernel runs, and both profiles count every timed run once."""
    from compiler.building.build import open_kernel
    from compiler.explaining.explain_profile import profile_bucket

    model = load_model(synthetic.fpn_model(), max_bytes=1 << 24)
    store = KernelStore(tmp_path / "kernels")
    outcome = compile_bucket(model, {"x": (1, 4, 32, 48)}, TARGET, store, CompileOptions(explain=True))
    _, report = _bundle(outcome)
    engine = _RunsRecorded(open_kernel(model, outcome, store))
    inputs = {"x": np.random.default_rng(0).standard_normal((1, 4, 32, 48)).astype(np.float32)}

    joined, profiles = profile_bucket(report, engine, model.data, inputs, runs=6, threads=1)

    tvm, onnxruntime = profiles["tvm"], profiles["onnxruntime"]
    assert tvm.runs == onnxruntime.runs == 6
    assert len(tvm.started_ns) == len(onnxruntime.started_ns) == 6
    turns = sorted([(t, "tvm") for t in tvm.started_ns] + [(t, "ort") for t in onnxruntime.started_ns])
    assert [engine for _, engine in turns] == ["tvm", "ort"] * 6, turns
    assert len(engine.runs_ns) >= 2 * 6  # the plain runs and the profiled ones both ran the loaded kernel
    assert joined["tvm"]["run_ms"] > 0 and joined["onnxruntime"]["run_ms"] > 0


def test_each_conv_kernel_is_traced_to_its_own_conv_where_binding_names_repeat(tmp_path):
    """A converter's unnamed bindings reuse their names (``lv``, ``lv1``, ... again for every conv): traced
    by name, the stem's kernel was also given a bottleneck's conv that took the name later, and the
    explain profile charged it that conv's ONNX Runtime time. A kernel that starts with its conv computes
    that conv (and its epilogue) only."""
    from tests.convnets import residual_model

    model = load_model(residual_model(), max_bytes=1 << 24)
    # For AVX2's 8-lane blocks whatever the host: AVX-512's 16 compute some of these convs as matmuls.
    avx2 = {**TARGET, "mcpu": "haswell"}
    outcome = compile_bucket(
        model, {"x": (1, 3, 64, 64)}, avx2, KernelStore(tmp_path / "k"), CompileOptions(explain=True)
    )
    _, report = _bundle(outcome)
    op = {node["index"]: node["op"] for node in report["nodes"]}
    leading = [kernel for kernel in report["kernels"] if kernel["name"].startswith("fused_conv2d")]
    assert len(leading) >= 4, [k["name"] for k in report["kernels"]]
    for kernel in leading:
        assert [op[i] for i in kernel["nodes"]].count("Conv") == 1, (kernel["name"], kernel["nodes"])
    stem = next(k for k in report["kernels"] if k["name"] == "fused_conv2d_add_relu")
    assert [op[i] for i in stem["nodes"]] == ["Conv", "Relu"]


def test_the_report_names_each_kernels_unit_and_its_share_of_the_time():
    from compiler.explaining.explain_report import unit_shares

    report = {"kernels": [{"name": "a", "unit": "int8 on avx2 (vpmaddwd)"}, {"name": "b", "unit": None}]}
    profile = {"kernels": [{"kernel": "a", "tvm_ms": 3.0}, {"kernel": "b", "tvm_ms": 1.0}]}
    assert unit_shares(report, profile) == {
        "int8 on avx2 (vpmaddwd)": "3.000 ms (75%)",
        "the vector unit (float)": "1.000 ms (25%)",
    }
    assert unit_shares({"kernels": [{"name": "b"}]}, profile) == {}  # a float model: nothing to say
