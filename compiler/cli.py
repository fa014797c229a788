"""``python -m compiler``: inspect and compile models from the shell.

Errors end with a non-zero exit status and one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from .errors import JitServeError


def _parse_shape(text: str) -> tuple[str, tuple[int, ...]]:
    name, sep, dims = text.rpartition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--shape {text!r}: expected NAME=D0,D1,...")
    try:
        shape = tuple(int(d) for d in dims.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape {text!r}: dims must be integers") from None
    return name, shape


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m compiler", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    inspect = commands.add_parser("inspect", help="print the signature and symbolic axes as JSON")
    inspect.add_argument("model")

    compile_ = commands.add_parser("compile", help="compile and verify one bucket, or reuse the stored kernel")
    compile_.add_argument("model")
    compile_.add_argument("--shape", action="append", type=_parse_shape, default=[], metavar="NAME=D0,D1,...")
    compile_.add_argument("--target", default=None, help="llvm, cuda or a JSON target dict")
    compile_.add_argument("--store", default=None, help="artifact store directory")
    compile_.add_argument("--rtol", type=float, default=None)
    compile_.add_argument("--atol", type=float, default=None)
    compile_.add_argument("--timeout", type=float, default=None, help="compile time limit, seconds")
    return parser


def _inspect(args, settings) -> dict:
    from .model import load_model_file

    model = load_model_file(args.model, max_bytes=settings.max_model_bytes)
    return {"digest": model.digest, "opset": model.opset, **model.signature.to_json()}


def _bucket_from_args(signature, shapes: list[tuple[str, tuple[int, ...]]]):
    from .buckets import BucketPlanner
    from .errors import BadRequestError

    given = dict(shapes)
    for spec in signature.inputs:
        if spec.name not in given:
            if spec.symbolic_axes():
                raise BadRequestError(
                    f"input {spec.name!r} has symbolic axes {list(spec.dims)}: give --shape {spec.name}=..."
                )
            given[spec.name] = tuple(spec.dims)
    return BucketPlanner(signature).plan(given).bucket


def _compile(args, settings) -> dict:
    from .build import CompileOptions, compile_bucket
    from .model import load_model_file
    from .store import ArtifactStore
    from .target import resolve_target

    started = time.perf_counter()
    model = load_model_file(args.model, max_bytes=settings.max_model_bytes)
    bucket = _bucket_from_args(model.signature, args.shape)
    try:
        target = resolve_target(args.target or settings.target, cuda_arch=settings.cuda_arch)
    except ValueError as exc:
        from .errors import BadRequestError

        raise BadRequestError(str(exc)) from None
    options = CompileOptions(
        rtol=args.rtol if args.rtol is not None else settings.verify_rtol,
        atol=args.atol if args.atol is not None else settings.verify_atol,
        seed=settings.verify_seed,
        timeout_seconds=args.timeout or settings.compile_timeout_seconds,
    )
    store = ArtifactStore(args.store or settings.kernel_store_dir)
    outcome = compile_bucket(model, bucket, target, store, options)
    manifest = outcome.manifest
    return {
        "key": manifest.key,
        "artifact": outcome.library_path,
        "bucket": manifest.bucket,
        "target": manifest.target,
        "compile_seconds": round(manifest.compile_seconds, 3),
        "cached": outcome.cached,
        "verified": manifest.verified,
        "verification": manifest.verification,
        "max_abs_error": manifest.max_abs_error,
        "simplified": manifest.simplified,
        "seconds": round(time.perf_counter() - started, 3),
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from .settings import Settings

    try:
        settings = Settings()
        result = _inspect(args, settings) if args.command == "inspect" else _compile(args, settings)
    except JitServeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    print(json.dumps(result, indent=2))
    return 0
