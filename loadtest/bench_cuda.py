"""CUDA kernels against PyTorch eager on one GPU: the zoo's torchvision models at batch 1 and 8.

    python loadtest/bench_cuda.py [--models resnet50 vit_b_16 ...] [--batches 1 8] [--runs 50]

Needs a CUDA GPU, torch and torchvision. Each model is the zoo's (``loadtest/zoo.py``: seeded random
weights, BatchNorm calibrated), exported where the zoo has no copy, and the torch module it was exported
from is the peer: PyTorch eager fp32 with TF32 off (cuDNN and cuBLAS), and PyTorch eager under float16
autocast for reference. Every TVM tier is compiled for this GPU and verified against fp32 ONNX Runtime
before it is timed:

- ``tvm``: fp32 kernels (dlight's default GPU rules, IEEE math);
- ``tvm_graph``: the same, the call captured as CUDA graphs;
- ``tvm_f16``: large matmuls on float16 tensor cores with float32 sums, within cosine 0.999 and top-5;
- ``tvm_f16_graph``: both.

The compiles run side by side (each in a child of its own); the timing runs one engine at a time, each
call from host arrays to host arrays (what a server's call does), median of ``--runs``. One JSON line per
bucket, ratios against PyTorch eager fp32.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "loadtest")]

TIERS = {
    "tvm": {},
    "tvm_graph": {"cuda_graph": True},
    "tvm_f16": {"precision": "f16"},
    "tvm_f16_graph": {"precision": "f16", "cuda_graph": True},
}


class TorchEngine:
    """A torch module on the GPU, called as an engine is: host arrays in, host arrays out."""

    def __init__(self, module, autocast: bool = False) -> None:
        import torch

        self.torch = torch
        self.module = module.cuda().eval()
        self.autocast = autocast

    def run(self, inputs: dict) -> dict:
        torch = self.torch
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16, enabled=self.autocast):
            answer = self.module(torch.from_numpy(inputs["x"]).cuda())
        return {"y": answer.float().cpu().numpy()}


def _compile_all(models: dict, batches: list[int], tiers: list[str], store, *, pool, log) -> dict:
    """Every (model, batch, tier)'s compile submitted to ``pool``: its future, which answers the outcome or
    None where it failed to build."""
    from compiler.building.build import compile_bucket
    from compiler.building.options import CompileOptions, CompileSettings
    from compiler.building.target import resolve_target
    from compiler.running.precision import AccuracyBudget

    settings = CompileSettings()
    target = resolve_target("cuda", cuda_arch="sm_90")
    f16_budget = AccuracyBudget(cosine=0.999, top_k=5)

    def build(name: str, batch: int, tier: str):
        extra = dict(TIERS[tier])
        if extra.get("precision") == "f16":
            extra["budget"] = f16_budget
        options = CompileOptions(
            rtol=settings.verify_rtol, atol=settings.verify_atol, timeout_seconds=settings.compile_timeout_seconds,
            **extra,
        )  # fmt: skip
        started = time.perf_counter()
        try:
            outcome = compile_bucket(models[name], {"x": (batch, 3, 224, 224)}, target, store, options)
        except Exception as exc:  # noqa: BLE001 - one tier that fails to build is reported, the rest go on
            log(f"{name} b{batch} {tier}: failed: {exc}")
            return None
        manifest = outcome.manifest
        log(f"{name} b{batch} {tier}: {time.perf_counter() - started:.0f}s verified={manifest.verified} "
            f"{manifest.verification}")  # fmt: skip
        return outcome

    return {
        (name, batch, tier): pool.submit(build, name, batch, tier)
        for name in models
        for batch in batches
        for tier in tiers
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["resnet50", "mobilenet_v3_large", "vit_b_16", "convnext_tiny"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--tiers", nargs="+", choices=sorted(TIERS), default=list(TIERS))
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--workers", type=int, default=8, help="compiles at once")
    parser.add_argument("--store", default=str(REPO / ".cache" / "cuda-bench-store"))
    parser.add_argument("--time-after", help="a file to wait for before timing (another GPU job's end)")
    parser.add_argument("--out", help="also append each bucket's JSON line to this file")
    args = parser.parse_args()

    import numpy as np
    import torch
    import zoo

    from compiler.building.build import open_kernel
    from compiler.measuring.timing import median_latencies_ms
    from compiler.models.model import load_model_file
    from compiler.running.arrays import random_inputs
    from compiler.storage.store import KernelStore

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    log(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    models = {}
    for name in args.models:
        path = zoo.zoo_path(name)
        if not path.is_file():
            zoo.export(name)
        models[name] = load_model_file(str(path), max_bytes=2 << 30)
    store = KernelStore(args.store)
    started = time.perf_counter()
    pool = ThreadPoolExecutor(args.workers)
    compiles = _compile_all(models, args.batches, args.tiers, store, pool=pool, log=log)
    lines = []
    for name in args.models:
        # A model is timed once its own compiles are done: the later models' may still run on the CPUs.
        outcomes = {job: future.result() for job, future in compiles.items() if job[0] == name}
        while args.time_after and not Path(args.time_after).exists():
            time.sleep(1)
        module, _ = zoo.torch_module(name)
        peers = {"torch": TorchEngine(module), "torch_f16_autocast": TorchEngine(module, autocast=True)}
        for batch in args.batches:
            inputs = random_inputs({"x": (batch, 3, 224, 224)}, {"x": "float32"}, 7)
            engines = dict(peers)
            facts: dict = {
                "model": name,
                "batch": batch,
                "compiles_running": sum(not f.done() for f in compiles.values()),
            }
            for tier in args.tiers:
                outcome = outcomes.get((name, batch, tier))
                if outcome is None or not outcome.manifest.verified:
                    facts[f"{tier}_verified"] = False
                    continue
                facts[f"{tier}_compile_seconds"] = round(outcome.manifest.compile_seconds, 1)
                engines[tier] = open_kernel(models[name], outcome, store, "cuda")
            # The peer is the model exported: its fp32 answer agrees with the fp32 kernel's.
            want = engines["torch"].run(inputs)["y"]
            if "tvm" in engines:
                got = engines["tvm"].run(inputs)["y"]
                facts["tvm_vs_torch_max_abs"] = float(np.max(np.abs(got - want)))
            latency = median_latencies_ms(engines, inputs, runs=args.runs, block=args.runs)
            torch_ms = latency["torch"]
            line = {
                **facts,
                **{f"{engine}_ms": round(ms, 3) for engine, ms in latency.items()},
                "ratio_vs_torch": {engine: round(ms / torch_ms, 2) for engine, ms in latency.items()},
            }
            print(json.dumps(line), flush=True)
            lines.append(line)
            if args.out:
                with open(args.out, "a") as out:
                    out.write(json.dumps(line) + "\n")
    pool.shutdown()
    log(f"median of {args.runs} calls each; {time.perf_counter() - started:.0f}s in all")
    print(table(lines, args.tiers))
    return 0


def table(lines: list[dict], tiers: list[str]) -> str:
    """Each bucket's PyTorch fp32 time and every engine's ratio to it (``-``: did not verify)."""
    engines = ["torch_f16_autocast", *tiers]
    rows = [
        "| model | batch | PyTorch fp32 ms | " + " | ".join(engines) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in engines) + " |",
    ]
    for line in lines:
        ratios = [f"{line['ratio_vs_torch'][e]:.2f}x" if e in line["ratio_vs_torch"] else "-" for e in engines]
        rows.append(f"| {line['model']} | {line['batch']} | {line['torch_ms']:.2f} | " + " | ".join(ratios) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
