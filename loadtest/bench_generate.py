"""Generation tokens/s of a decoder with a key/value cache: jitserve's generation loop against a plain ONNX
Runtime loop and ONNX Runtime GenAI, all over the same ONNX file on this machine's CPU.

    .cache/zoo-venv/bin/python loadtest/zoo.py --only gpt2_kv         # or `make zoo`
    python3 -m venv .cache/genai-venv && .cache/genai-venv/bin/pip install onnxruntime-genai
    .venv/bin/python loadtest/bench_generate.py [--model M.onnx] [--genai-model DIR] [--genai-python PY]
        [--prompt 128] [--new 128] [--streams 8] [--runs 3]

The model is the zoo's ``gpt2_kv`` (GPT-2 small with random weights, its cache as inputs and outputs) unless
``--model`` names another decoder compiler.models.decoder recognises. Each stream has a prompt of ``--prompt``
random token ids (seed 0; stream 0's prompt is the batch-1 prompt) and generates ``--new`` greedy tokens:

- jitserve: ``server.runtime.generation.generator.Generator`` over the model's ONNX Runtime engine as the
  server builds it, at 1 stream and at ``--streams`` concurrent streams (decoded as one batch each step);
- ONNX Runtime: a plain greedy loop at batch 1 over the same session (the server's, built with its settings:
  ``generate_ort_threads``, spinning while a call lasts), each step's ``present`` fed back as ``past`` by hand;
- ONNX Runtime GenAI: its greedy search at batch 1 and over the ``--streams`` prompts as one batch, run by
  ``--genai-python`` (GenAI lives in an environment of its own) over ``--genai-model``, a folder with a
  ``genai_config.json`` beside the model. GenAI's model builder makes no GPT-2, so where the folder has no
  config this script writes one from the decoder's recognised names and links the model in. GenAI's session
  gets ``--genai-threads`` intra-op threads, by default what ONNX Runtime's sessions take by default (the
  physical cores): left to itself GenAI runs one thread here, half the speed on two cores.

Tokens/s counts the new tokens over the time from the submission of the prompts to the last token (the
prefill included). The first token's latency and the gaps between a stream's tokens (p50 and p99, over every
stream of every measured run) are shown apart. Each figure is the median of ``--runs`` runs after a warm-up.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loadtest.zoo import zoo_path  # noqa: E402  (standard library only: the GenAI worker imports it too)

GENAI_MODEL = REPO / ".cache" / "genai" / "gpt2_kv"
GENAI_PYTHON = REPO / ".cache" / "genai-venv" / "bin" / "python"


@dataclass
class Run:
    """One run of one engine: each stream's tokens and when each came, in seconds from the submission."""

    tokens: list[list[int]]
    times: list[list[float]]

    @property
    def tokens_per_second(self) -> float:
        return sum(map(len, self.tokens)) / max(times[-1] for times in self.times)


@dataclass
class Row:
    engine: str
    streams: int
    runs: list[Run]

    def figures(self) -> dict[str, float]:
        gaps = [gap for run in self.runs for times in run.times for gap in np.diff(times)]
        return {
            "tokens/s": statistics.median(run.tokens_per_second for run in self.runs),
            "first token ms": 1000 * statistics.median(times[0] for run in self.runs for times in run.times),
            "gap p50 ms": 1000 * float(np.percentile(gaps, 50)),
            "gap p99 ms": 1000 * float(np.percentile(gaps, 99)),
        }


def jitserve_runs(generator, prompts: list[list[int]], new: int, runs: int) -> list[Run]:
    """The prompts submitted together to ``generator``, each stream read by a thread of its own as a
    client reads its stream; ``runs`` runs after a warm-up."""
    from server.runtime.generation.generator import DONE, TOKEN
    from server.runtime.generation.sampling import SamplingParameters

    def follow(sequence, started: float) -> tuple[list[int], list[float]]:
        tokens, times = [], []
        while True:
            kind, value = sequence.events.get(timeout=600)
            if kind != TOKEN:
                if kind != DONE:
                    raise RuntimeError(f"generation failed: {value}")
                return tokens, times
            times.append(time.perf_counter() - started)
            tokens.append(value)

    measured = []
    with ThreadPoolExecutor(len(prompts)) as readers:
        for _ in range(runs + 1):
            started = time.perf_counter()
            sequences = [generator.submit(prompt, SamplingParameters(max_tokens=new)) for prompt in prompts]
            streams = [future.result() for future in [readers.submit(follow, s, started) for s in sequences]]
            measured.append(Run([tokens for tokens, _ in streams], [times for _, times in streams]))
    return measured[1:]


def ort_loop_run(session, spec, prompt: list[int], new: int) -> Run:
    """The plain greedy loop: the prompt against an empty cache, then one token at a time, each step's
    ``present`` handed back as the next one's ``past``."""
    empty = np.zeros((1, spec.heads, 0, spec.head_dim), spec.cache_dtype)
    past = {name: empty for pair in spec.past for name in pair}
    ids, length = np.array([prompt], np.int64), 0
    tokens, times = [], []
    started = time.perf_counter()
    for _ in range(new):
        count = ids.shape[1]
        feeds = {spec.tokens: ids, **past}
        if spec.mask:
            feeds[spec.mask] = np.ones((1, length + count), np.int64)
        if spec.positions:
            feeds[spec.positions] = np.arange(length, length + count, dtype=np.int64)[None]
        names = [spec.logits, *(name for pair in spec.present for name in pair)]
        logits, *present = session.run(names, feeds)
        past = dict(zip((name for pair in spec.past for name in pair), present, strict=True))
        length += count
        tokens.append(int(np.argmax(logits[0, -1])))
        times.append(time.perf_counter() - started)
        ids = np.array([[tokens[-1]]], np.int64)
    return Run([tokens], [times])


def write_genai_folder(folder: Path, model: Path, spec) -> bool:
    """GenAI's model folder for ``model``: a ``genai_config.json`` naming the decoder's inputs and outputs,
    written where the folder has none, and the model linked in. Whether it wrote one."""
    config = folder / "genai_config.json"
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / model.name
    if link.is_symlink() and link.resolve() != model.resolve():  # left by an older zoo's export
        link.unlink()
    if not link.exists():
        link.symlink_to(os.path.relpath(model.resolve(), folder.resolve()))
    if config.is_file():
        return False

    def per_layer(name: str) -> str:  # past_key_values.0.key -> past_key_values.%d.key
        return name.replace(".0.", ".%d.", 1)

    inputs = {"input_ids": spec.tokens, "past_key_names": per_layer(spec.past[0][0]),
              "past_value_names": per_layer(spec.past[0][1])}  # fmt: skip
    if spec.mask:
        inputs["attention_mask"] = spec.mask
    if spec.positions:
        inputs["position_ids"] = spec.positions
    outputs = {"logits": spec.logits, "present_key_names": per_layer(spec.present[0][0]),
               "present_value_names": per_layer(spec.present[0][1])}  # fmt: skip
    context = spec.max_positions or 2048
    end = spec.vocab - 1  # GPT-2's <|endoftext|> is its last id; the benchmark's greedy runs never stop on it
    decoder = {
        "filename": model.name,
        "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
        "head_size": spec.head_dim,
        "hidden_size": spec.heads * spec.head_dim,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.heads,
        "num_hidden_layers": spec.layers,
        "inputs": inputs,
        "outputs": outputs,
    }
    search = {
        "do_sample": False,
        "num_beams": 1,
        "max_length": context,
        "min_length": 0,
        # present is past + new positions, not one buffer of max_length that GenAI would write in place
        "past_present_share_buffer": False,
    }
    body = {"model": {"type": "decoder", "context_length": context, "vocab_size": spec.vocab, "bos_token_id": end,
                      "eos_token_id": end, "pad_token_id": end, "decoder": decoder}, "search": search}  # fmt: skip
    config.write_text(json.dumps(body, indent=2) + "\n")
    return True


def genai_worker() -> int:
    """Run by GenAI's Python: the job as JSON on stdin, its runs per batch as JSON on stdout."""
    import onnxruntime_genai as og

    job = json.load(sys.stdin)
    config = og.Config(job["model"])
    if job["threads"]:
        threads = {"session_options": {"intra_op_num_threads": job["threads"]}}
        config.overlay(json.dumps({"model": {"decoder": threads}}))
    model = og.Model(config)
    result = {"version": og.__version__, "onnxruntime": importlib.metadata.version("onnxruntime"), "runs": {}}
    for batch in job["batches"]:
        prompts = np.array(job["prompts"][:batch], np.int32)
        runs = []
        for _ in range(job["runs"] + 1):
            params = og.GeneratorParams(model)
            params.set_search_options(do_sample=False, max_length=prompts.shape[1] + job["new"], batch_size=batch)
            generator = og.Generator(model, params)
            steps, times = [], []
            started = time.perf_counter()
            generator.append_tokens(prompts)  # the prefill
            while not generator.is_done():
                generator.generate_next_token()
                steps.append(generator.get_next_tokens().tolist())
                times.append(time.perf_counter() - started)
            del generator
            runs.append(asdict(Run([list(stream) for stream in zip(*steps, strict=True)], [times] * batch)))
        result["runs"][str(batch)] = runs[1:]
    print(json.dumps(result))
    return 0


def physical_cores() -> int:
    """The physical cores among this process's CPUs: ONNX Runtime's default intra-op thread count."""
    cores = set()
    for cpu in os.sched_getaffinity(0):
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text(), (topology / "core_id").read_text()))
        except OSError:
            cores.add(cpu)
    return len(cores)


def cpu_line() -> str:
    from loadtest.bench_table import cpuinfo_field

    flags = set(cpuinfo_field("flags").split())
    amx = [flag for flag in ("amx_tile", "amx_bf16", "amx_int8") if flag in flags]
    summary = ", ".join(f"{flag} {'yes' if flag in flags else 'no'}" for flag in ("avx2", "avx512f"))
    return (
        f"CPU: {cpuinfo_field('model name') or '?'} ({summary}, amx {'/'.join(amx) or 'no'}); "
        f"{len(os.sched_getaffinity(0))} cores usable, load average {os.getloadavg()[0]:.1f} at the start"
    )


def same(tokens: list[int], reference: list[int]) -> str:
    if tokens == reference:
        return "yes"
    first = next((i for i, (a, b) in enumerate(zip(tokens, reference, strict=False)) if a != b), None)
    return f"no (from token {first if first is not None else min(len(tokens), len(reference))})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=zoo_path("gpt2_kv"), help="the decoder (default: %(default)s)")
    parser.add_argument("--genai-model", type=Path, default=GENAI_MODEL, help="GenAI's folder (default: %(default)s)")
    parser.add_argument("--genai-python", type=Path, default=GENAI_PYTHON, help="a Python with onnxruntime_genai")
    parser.add_argument("--genai-threads", type=int, default=physical_cores(),
                        help="GenAI's intra-op threads; 0: its own default (default: %(default)s)")  # fmt: skip
    parser.add_argument("--no-genai", action="store_true", help="leave ONNX Runtime GenAI out")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per stream")
    parser.add_argument("--new", type=int, default=128, help="new tokens per stream")
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams, and GenAI's batch")
    parser.add_argument("--runs", type=int, default=3, help="measured runs per figure, after a warm-up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--genai-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.genai_worker:
        return genai_worker()

    import onnxruntime as ort

    from compiler.models.decoder import recognize_decoder
    from compiler.models.model import load_model_file
    from server.runtime.generation.generator import Generator
    from server.runtime.generation.kv_blocks import KvBlocks
    from server.runtime.models.model_checks import open_onnxruntime
    from server.runtime.observability.metrics import Metrics
    from server.settings import Settings

    if not args.model.is_file():
        raise SystemExit(f"{args.model} is missing: `.cache/zoo-venv/bin/python loadtest/zoo.py --only gpt2_kv`")
    loaded = load_model_file(str(args.model), max_bytes=2**31 - 1)
    spec = recognize_decoder(loaded.signature, loaded.index_bounds)
    if spec is None:
        raise SystemExit(f"{args.model} is no decoder with a key/value cache")
    print(cpu_line(), flush=True)
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(0, spec.vocab, (args.streams, args.prompt)).tolist()

    # As the server builds them (server/runtime/generation/generation.py): the model's ONNX Runtime engine with
    # the server's settings (a decoder's threads and spinning), the cache sized for every stream.
    engine = open_onnxruntime(Settings(), loaded, {"kind": "llvm"})
    del loaded
    session = engine.session
    threads = session.get_session_options().intra_op_num_threads or "default"
    blocks = KvBlocks(args.streams * -(-(args.prompt + args.new) // 16), 16, spec.cache_bytes_per_position())
    generator = Generator("bench", spec, engine, blocks, Metrics().generation, max_batch=args.streams,
                          max_waiting=args.streams, max_tokens=args.new)  # fmt: skip
    rows = []
    try:
        for streams in sorted({1, args.streams}):
            print(f"jitserve, {streams} stream(s)...", file=sys.stderr, flush=True)
            rows.append(Row("jitserve Generator", streams, jitserve_runs(generator, prompts[:streams], args.new,
                                                                           args.runs)))  # fmt: skip
    finally:
        generator.close()
    print("ONNX Runtime loop...", file=sys.stderr, flush=True)
    loop = [ort_loop_run(session, spec, prompts[0], args.new) for _ in range(args.runs + 1)][1:]
    rows.append(Row("ONNX Runtime loop", 1, loop))
    del generator, session, engine  # its threads and weights leave the machine to GenAI's process

    genai_note = "ONNX Runtime GenAI: left out (--no-genai)"
    if not args.no_genai and not args.genai_python.is_file():
        genai_note = f"ONNX Runtime GenAI: left out ({args.genai_python} is missing)"
    elif not args.no_genai:
        if write_genai_folder(args.genai_model, args.model, spec):
            print(f"wrote {args.genai_model / 'genai_config.json'}", file=sys.stderr)
        print("ONNX Runtime GenAI...", file=sys.stderr, flush=True)
        job = {"model": str(args.genai_model), "prompts": prompts, "new": args.new, "runs": args.runs,
               "batches": sorted({1, args.streams}), "threads": args.genai_threads}  # fmt: skip
        done = subprocess.run([str(args.genai_python), __file__, "--genai-worker"], input=json.dumps(job),
                              capture_output=True, text=True, check=False)  # fmt: skip
        if done.returncode:
            raise SystemExit(f"the GenAI worker failed:\n{done.stderr[-4000:]}")
        result = json.loads(done.stdout.splitlines()[-1])
        threads = f"{args.genai_threads} intra-op threads" if args.genai_threads else "its default threads"
        genai_note = f"ONNX Runtime GenAI {result['version']} (its onnxruntime {result['onnxruntime']}, {threads})"
        for batch, runs in result["runs"].items():
            rows.append(Row("ONNX Runtime GenAI", int(batch), [Run(**run) for run in runs]))

    reference = loop[0].tokens[0]
    genai = {row.streams: row.figures()["tokens/s"] for row in rows if row.engine == "ONNX Runtime GenAI"}
    print(f"{args.model.name}: {spec.layers} layers, {spec.heads} heads; {args.prompt}-token random prompts, "
          f"{args.new} greedy tokens each; median of {args.runs} runs after a warm-up; onnxruntime "
          f"{ort.__version__} ({threads} intra-op threads, as the server runs a decoder); {genai_note}\n")  # fmt: skip
    print("| engine | streams | tokens/s | / GenAI | first token ms | gap p50 ms | gap p99 ms | tokens = ORT loop's |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        figures = row.figures()
        ratio = f"{figures['tokens/s'] / genai[row.streams]:.2f}" if row.streams in genai else "-"
        equal = same(row.runs[0].tokens[0], reference)
        if any(run.tokens[0] != row.runs[0].tokens[0] for run in row.runs):
            equal += ", runs differ"
        print(f"| {row.engine} | {row.streams} | {figures['tokens/s']:.1f} | {ratio} | "
              f"{figures['first token ms']:.0f} | {figures['gap p50 ms']:.1f} | {figures['gap p99 ms']:.1f} | "
              f"{equal}{' (stream 0)' if row.streams > 1 else ''} |")  # fmt: skip
    batched = [row for row in rows if row.streams == args.streams > 1]
    if len(batched) == 2:
        streams = [row.runs[0].tokens for row in batched]
        agree = sum(a == b for a, b in zip(*streams, strict=True))
        print(f"\n{batched[0].engine} and {batched[1].engine} at {args.streams} streams: {agree} of "
              f"{args.streams} streams generated the same tokens")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
