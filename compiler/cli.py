"""``python -m compiler``: inspect and compile models from the shell.

Errors end with a non-zero exit status and one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .errors import JitServeError


def _parse_shape(text: str) -> tuple[str, tuple[int, ...]]:
    name, sep, dims = text.rpartition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--shape {text!r}: expected NAME=D0,D1,...")
    try:
        shape = tuple(int(d) for d in dims.split(",")) if dims else ()  # NAME= is a scalar
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape {text!r}: dims must be integers") from None
    return name, shape


def _add_bucket_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model")
    parser.add_argument(
        "--shape",
        action="append",
        type=_parse_shape,
        default=[],
        metavar="NAME=D0,D1,...",
        help="the bucket's input shapes; repeating a NAME starts the next bucket",
    )
    parser.add_argument("--target", default=None, help="llvm, cuda or a JSON target dict")
    parser.add_argument("--store", default=None, help="artifact store directory")
    parser.add_argument(
        "--cosine",
        type=float,
        default=None,
        help="verify within this least cosine similarity to ONNX Runtime instead of fp32's tolerances "
        "(a quantized model's int8 contract, as its owner's budget would say)",
    )
    parser.add_argument("--top-k", type=int, default=None, help="with or instead of --cosine: top class among k")
    parser.add_argument(
        "--precision",
        choices=("fp32", "bf16", "f16"),
        default="fp32",
        help="bf16: matmuls by weights with bf16 operands and float32 sums, on a CPU with AVX512-BF16; f16: "
        "matmuls with float16 operands and float32 sums on CUDA's tensor cores (give a budget)",
    )
    parser.add_argument(
        "--cuda-graph",
        action="store_true",
        help="CUDA, static buckets: capture the kernels as CUDA graphs, replayed each call (bench on CUDA times both)",
    )


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    inspect = commands.add_parser("inspect", help="print the signature and symbolic axes as JSON")
    inspect.add_argument("model")

    compile_ = commands.add_parser("compile", help="compile and verify buckets, or reuse the stored kernels")
    _add_bucket_arguments(compile_)
    compile_.add_argument("--rtol", type=float, default=None)
    compile_.add_argument("--atol", type=float, default=None)
    compile_.add_argument("--timeout", type=float, default=None, help="compile time limit, seconds")

    bench = commands.add_parser("bench", help="compile each bucket and time it against ONNX Runtime")
    _add_bucket_arguments(bench)
    bench.add_argument("--runs", type=int, default=20, help="timed runs per engine (median reported)")
    bench.add_argument("--tune-trials", type=int, default=0, help="also tune each bucket with N MetaSchedule trials")
    bench.add_argument(
        "--tune-trials-per-task", type=int, default=None, help="at most this many for one kernel (the server's setting)"
    )
    bench.add_argument(
        "--timeout", type=float, default=None, help="compile time limit, seconds (a tuning compile tunes for 3/4 of it)"
    )
    bench.add_argument("--plot", default=None, metavar="FILE.png", help="draw the ratios against ONNX Runtime")
    bench.add_argument(
        "--profile",
        action="store_true",
        help="also time each compiled kernel and each ONNX Runtime node (printed to stderr, and in the JSON)",
    )
    bench.add_argument(
        "--ort-no-spin",
        action="store_true",
        help="time ONNX Runtime as the server runs it (no spinning threads) instead of with its own defaults",
    )
    explain = commands.add_parser(
        "explain",
        help="compile each bucket afresh and write its explain bundle (IR per stage, kernels traced to nodes)",
    )
    _add_bucket_arguments(explain)
    explain.add_argument("-o", "--output", required=True, help="directory to write one bundle per bucket into")
    explain.add_argument("--no-code", action="store_true", help="leave the generated code out of the bundles")
    explain.add_argument(
        "--no-profile", action="store_true", help="leave out the per-kernel time profile against ONNX Runtime"
    )
    explain.add_argument("--runs", type=int, default=10, help="timed runs per engine for the profile")
    return parser


def _inspect(args, settings) -> dict:
    from .models.model import load_model_file

    model = load_model_file(args.model, max_bytes=settings.max_model_bytes)
    return {"digest": model.digest, "opset": model.opset, **model.signature.to_json()}


def _bucket_from_args(signature, shapes: list[tuple[str, tuple[int, ...]]]):
    from .errors import BadRequestError
    from .shapes.buckets import BucketPlanner

    given = signature.with_static_inputs(dict(shapes))
    for spec in signature.inputs:
        if spec.name not in given:
            raise BadRequestError(
                f"input {spec.name!r} has symbolic axes {list(spec.dims)}: give --shape {spec.name}=..."
            )
    return BucketPlanner(signature).plan(given).bucket


def _group_buckets(shapes: list[tuple[str, tuple[int, ...]]]) -> list[list[tuple[str, tuple[int, ...]]]]:
    """A name seen again starts the next bucket: x=1,.. x=8,.. is two buckets."""
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    for name, shape in shapes:
        if any(name == seen for seen, _ in groups[-1]):
            groups.append([])
        groups[-1].append((name, shape))
    return groups


def _compile_context(args, settings, *, spinning: bool = True):
    from .building.options import CompileOptions
    from .building.target import resolve_target
    from .building.threads import apply_thread_plan
    from .errors import BadRequestError
    from .models.model import load_model_file
    from .storage.store import KernelStore

    model = load_model_file(args.model, max_bytes=settings.max_model_bytes)
    buckets = [_bucket_from_args(model.signature, group) for group in _group_buckets(args.shape)]
    # Before any kernel runs here or in a compile child: they inherit the plan.
    kernel_threads = apply_thread_plan(settings.kernel_threads, spinning=spinning)
    try:
        target = resolve_target(args.target or settings.target, cuda_arch=settings.cuda_arch, num_cores=kernel_threads)
    except ValueError as exc:
        raise BadRequestError(str(exc)) from None
    options = CompileOptions(
        rtol=getattr(args, "rtol", None) or settings.verify_rtol,
        atol=getattr(args, "atol", None) or settings.verify_atol,
        seed=settings.verify_seed,
        timeout_seconds=getattr(args, "timeout", None) or settings.compile_timeout_seconds,
        memory_limit_bytes=settings.compile_memory_bytes,
        shipped_tuning=settings.shipped_tuning,
        budget=_budget(args),
        precision=_precision(args, target),
        cuda_graph=_cuda_graph(args, target),
    )
    store = KernelStore(args.store or settings.kernel_store_dir)
    return model, buckets, target, options, store


def _cuda_graph(args, target: dict) -> bool:
    """``--cuda-graph``, refused off CUDA."""
    from .errors import BadRequestError

    if getattr(args, "cuda_graph", False) and target["kind"] != "cuda":
        raise BadRequestError(f"--cuda-graph captures CUDA kernels, not {target['kind']} ones")
    return getattr(args, "cuda_graph", False)


def _precision(args, target: dict) -> str:
    """``--precision``, refused where the host CPU (the target it compiles for) has no unit for it."""
    from .building.matrix_units import host_matrix_units
    from .building.options import TENSOR_CORE_PRECISIONS
    from .errors import BadRequestError

    precision = getattr(args, "precision", "fp32")
    on_cuda = precision in TENSOR_CORE_PRECISIONS
    if precision != "fp32" and (target["kind"] == "cuda") != on_cuda:
        where = "CUDA's tensor cores" if on_cuda else "the CPU's matrix units"
        raise BadRequestError(f"--precision {precision} compiles for {where} only, not for {target['kind']}")
    if precision != "fp32" and target["kind"] == "llvm":
        missing = host_matrix_units().missing(precision)
        if missing:
            raise BadRequestError(f"--precision {precision}: {missing}")
    return precision


def _budget(args):
    """The accuracy budget ``--cosine`` / ``--top-k`` give, or None."""
    from pydantic import ValidationError

    from .errors import BadRequestError
    from .running.precision import AccuracyBudget

    if getattr(args, "cosine", None) is None and getattr(args, "top_k", None) is None:
        return None
    try:
        return AccuracyBudget(cosine=args.cosine, top_k=args.top_k)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise BadRequestError(f"--cosine/--top-k: {problems}") from None


def _compile(args, settings) -> list[dict]:
    from .building.build import compile_bucket

    model, buckets, target, options, store = _compile_context(args, settings)
    results = []
    for bucket in buckets:
        started = time.perf_counter()
        outcome = compile_bucket(model, bucket, target, store, options)
        manifest = outcome.manifest
        results.append(
            {
                "key": manifest.key,
                "artifact": outcome.library_path,
                "bucket": manifest.bucket,
                "target": manifest.target,
                "compile_seconds": round(manifest.compile_seconds, 3),
                "compile_stages": manifest.compile_stages,
                "cached": outcome.cached,
                "verified": manifest.verified,
                "verification": manifest.verification,
                "max_abs_error": manifest.max_abs_error,
                "simplified": manifest.simplified,
                "seconds": round(time.perf_counter() - started, 3),
            }
        )
    return results


def _explain(args, settings) -> list[dict]:
    """Compiles in a store of its own: a kernel reused from a store may have been built without a bundle."""
    import shutil
    import tempfile

    from .building.build import compile_bucket
    from .explaining.explain_report import write_html
    from .shapes.buckets import bucket_label
    from .storage.store import EXPLAIN_DIR, KernelStore

    # The profile alternates the engines run by run: neither spins between runs, as the server default.
    model, buckets, target, options, _ = _compile_context(args, settings, spinning=False)
    options = options.model_copy(update={"explain": True, "explain_code": not args.no_code})
    output = Path(args.output)
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        store = KernelStore(scratch)
        for bucket, given in zip(buckets, _group_buckets(args.shape), strict=True):
            outcome = compile_bucket(model, bucket, target, store, options)
            label = bucket_label(outcome.manifest.bucket)
            destination = output / "".join(c if c.isalnum() or c in "=.-_@" else "_" for c in label)
            shutil.rmtree(destination, ignore_errors=True)
            shutil.copytree(Path(outcome.library_path).parent / EXPLAIN_DIR, destination)
            report = json.loads((destination / "explain.json").read_text())
            result = {
                "bucket": label,
                "explain": str(destination),
                "kernels": len(report["kernels"]),
                "compute_coverage": report["compute_coverage"],
                "verified": outcome.manifest.verified,
                "compile_seconds": round(outcome.manifest.compile_seconds, 3),
            }
            if not args.no_profile and outcome.manifest.verified:
                joined = _profile_explained(model, outcome, store, destination, shapes=dict(given), runs=args.runs)
                result |= {"tvm_run_ms": joined["tvm"]["run_ms"], "ort_run_ms": joined["onnxruntime"]["run_ms"],
                           "accounted": joined["accounted"]}  # fmt: skip
            write_html(destination, command=["python -m compiler", *sys.argv[1:]])
            results.append(result | {"report": str(destination / "index.html")})
    return results


def _profile_explained(model, outcome, store, destination, *, shapes, runs) -> dict:
    """Each kernel's time beside ONNX Runtime's on the same nodes, at the shape given (a dynamic bucket
    runs it unpadded), into the bundle: the server's profile, in this process."""
    from .building.build import profile_job
    from .explaining.explain_profile import profile_stored

    manifest = outcome.manifest
    sizes = {name: [d if isinstance(d, int) else shapes[name][i] for i, d in enumerate(dims)]
             for name, dims in manifest.bucket.items()}  # fmt: skip
    return profile_stored(profile_job(model, manifest, store, destination, sizes, runs=runs))


def _bench(args, settings) -> list[dict]:
    from .measuring.bench import bench_bucket
    from .running.openvino_engine import openvino_available

    model, buckets, target, options, store = _compile_context(args, settings)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    results = [
        bench_bucket(
            model,
            b,
            target,
            store,
            options,
            runs=args.runs,
            tune_trials=args.tune_trials,
            tune_trials_per_task=args.tune_trials_per_task or settings.tune_trials_per_task,
            ort_threads=settings.kernel_threads or None,
            ort_spinning=not args.ort_no_spin,
            profile=args.profile,
            openvino=settings.openvino and openvino_available(),
            log=log,
        )
        for b in buckets
    ]
    if args.plot:
        from .measuring.bench import plot_ratios

        plot_ratios(results, args.plot, title=Path(args.model).name)
        log(f"plot written to {args.plot}")
    return results


def main(argv: list[str] | None = None, *, prog: str = "python -m compiler") -> int:
    args = _parser(prog).parse_args(argv)
    from .building.options import CompileSettings

    try:
        settings = CompileSettings()
        command = {"inspect": _inspect, "compile": _compile, "bench": _bench, "explain": _explain}[args.command]
        result = command(args, settings)
    except JitServeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    # compile, bench and explain print one JSON object per bucket, one per line.
    for item in result if isinstance(result, list) else [result]:
        print(json.dumps(item, indent=None if isinstance(result, list) else 2))
    return 0
