"""What a model costs in memory, bucket by bucket, against a real server with the settings users run
(OpenVINO on where it is installed): the issue's table of a model's life.

    .venv/bin/python loadtest/memory_bench.py                       # BERT-base from the zoo (make zoo)
    .venv/bin/python loadtest/memory_bench.py MODEL.onnx --bucket input_ids=1,128 --bucket ...

Each ``--bucket`` names one input's shape (repeat an input's name to start the next bucket); inputs a
bucket does not name take its other inputs' symbolic sizes. Steps, each one's server RSS over the
server's own after a warm-up model (a 1-layer encoder of hidden 768) loaded the engines' libraries, was
served and was deleted:

1. the upload, timed from its body's last byte sent to the answer, and its padding probe (after the answer);
2. each bucket: one request, then until its compile and every engine's measurement settle, then a
   request served by the engine routed to it;
3. a new version with new weights and the same graph (``?replace=true``): the TVM compiles it took;
4. the delete, and what stays 3 s later.

Prints a table (MiB and multiples of the weights) and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compiler.models.weights import weight_bytes
from loadtest.common import start_server
from loadtest.compare import cpu_line
from loadtest.zoo import zoo_path
from tests import synthetic
from tests.integration.serverproc import metric_value

BERT_BUCKETS = [
    {"input_ids": (1, 128), "attention_mask": (1, 128)},
    {"input_ids": (2, 128), "attention_mask": (2, 128)},
    {"input_ids": (1, 64), "attention_mask": (1, 64)},
]


def parse_buckets(items: list[str]) -> list[dict[str, tuple[int, ...]]]:
    """``["a=1,8", "b=1,8", "a=2,8"]`` -> two buckets: a name seen again starts the next one."""
    buckets: list[dict[str, tuple[int, ...]]] = [{}]
    for item in items:
        name, _, dims = item.rpartition("=")
        if name in buckets[-1]:
            buckets.append({})
        buckets[-1][name] = tuple(int(d) for d in dims.split(","))
    return buckets


def inputs_for(model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, list]:
    rng = np.random.default_rng(seed)
    inputs = {}
    for spec in model.graph.input:
        shape = shapes[spec.name]
        elem = spec.type.tensor_type.elem_type
        if elem in (onnx.TensorProto.INT64, onnx.TensorProto.INT32):
            # Token ids and masks: small ids are in every vocabulary; a mask of ones.
            value = np.ones(shape, np.int64) if "mask" in spec.name else rng.integers(0, 100, shape)
        else:
            value = rng.standard_normal(shape).astype(np.float32)
        inputs[spec.name] = value.tolist()
    return inputs


class Server:
    def __init__(self, url: str) -> None:
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=600)

    def rss(self) -> float:
        time.sleep(0.5)  # the gauge is read as /metrics is scraped; let a just-freed block go first
        return metric_value(self.http.get("/metrics").text, "jitserve_resident_memory_bytes")

    def compiles(self, model: str, tier: str) -> float:
        return metric_value(self.http.get("/metrics").text, "jitserve_compiles_total", model=model, tier=tier)

    def upload(self, name: str, data: bytes, config: dict, replace: bool = False) -> float:
        """PUT the model as multipart; the seconds from its body's last byte sent to the answer."""
        boundary = uuid.uuid4().hex
        parts = [
            (f'--{boundary}\r\nContent-Disposition: form-data; name="model"; filename="model.onnx"\r\n'
             "Content-Type: application/octet-stream\r\n\r\n").encode(),
            data,
            (f'\r\n--{boundary}\r\nContent-Disposition: form-data; name="config"; filename="config.json"\r\n'
             f"Content-Type: application/json\r\n\r\n{json.dumps(config)}\r\n--{boundary}--\r\n").encode(),
        ]  # fmt: skip
        sent = []

        def body():
            for part in parts:
                for start in range(0, len(part), 1 << 20):
                    yield part[start : start + (1 << 20)]
            sent.append(time.perf_counter())

        response = self.http.put(
            f"/models/{name}",
            params={"replace": "true"} if replace else None,
            content=body(),
            headers={"content-type": f"multipart/form-data; boundary={boundary}"},
        )
        answered = time.perf_counter()
        if response.status_code != 201:
            raise RuntimeError(f"upload {name}: {response.status_code} {response.text}")
        return answered - sent[0]

    def predict(self, name: str, inputs: dict) -> dict:
        response = self.http.post("/predict", json={"model": name, "inputs": inputs})
        if response.status_code != 200:
            raise RuntimeError(f"predict {name}: {response.status_code} {response.text}")
        return response.json()

    def probed(self, name: str, timeout: float = 600) -> dict:
        """Until the model's padding probe (run after the upload answers) has ended."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            probe = self.http.get(f"/models/{name}").json().get("padding_probe") or {"state": "done"}
            if probe["state"] in ("done", "failed"):
                return probe
            time.sleep(0.2)
        raise TimeoutError(f"{name}'s padding probe did not end in {timeout:g} s")

    def settle(self, name: str, label: str, timeout: float = 1800) -> dict:
        """Until the bucket is ready (compiled, every engine measured and routed) or failed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            buckets = self.http.get(f"/models/{name}").json()["buckets"]
            found = next((b for b in buckets if b["bucket"] == label), None)
            queued = metric_value(self.http.get("/metrics").text, "jitserve_compile_queue_depth")
            # Ready a moment before its compile ends (the engines measured slower are let go then).
            if found is not None and found["state"] in ("ready", "failed") and not queued:
                return found
            time.sleep(0.5)
        raise TimeoutError(f"{name} {label} did not settle in {timeout:g} s")


def bucket_label(shapes: dict[str, tuple[int, ...]]) -> str:
    return ",".join(f"{name}={'x'.join(str(d) for d in dims)}" for name, dims in shapes.items())


def run(model_path: Path | None, buckets: list[dict], settings: dict) -> dict:
    data = model_path.read_bytes() if model_path else synthetic.bert_encoder_model(layers=12, hidden=768, heads=12)
    proto = onnx.load_from_string(data)
    weights = weight_bytes(proto)
    retrained = synthetic.reweighted(data, 7)
    config = {"axes": {}}
    rows: list[tuple[str, float, str]] = []
    with tempfile.TemporaryDirectory() as data_dir:
        process, url = start_server(data_dir, compile_min_hits=1, **settings)
        server = Server(url)
        try:
            # The engines' libraries (TVM, ONNX Runtime, OpenVINO) and their caches load with the first model of
            # real width: not the model's cost (OpenVINO's runtime keeps about 20 MiB after its first).
            tiny = synthetic.bert_encoder_model(layers=1, hidden=768, heads=12, seq=128)
            server.upload("warmup", tiny, {"warm_buckets": [{"x": [1, 128, 768]}]})
            server.probed("warmup")
            server.settle("warmup", "x=1x128x768")
            server.predict("warmup", {"x": np.zeros((1, 128, 768), np.float32).tolist()})
            server.http.delete("/models/warmup")
            time.sleep(3)
            start = server.rss()

            upload_seconds = server.upload("big", data, config)
            probe = server.probed("big")
            note = f"answered in {upload_seconds:.1f} s; its padding probe took {probe.get('seconds')} s after that"
            rows.append(("after upload", server.rss() - start, note))
            engines = []
            for index, shapes in enumerate(buckets):
                inputs = inputs_for(proto, shapes, index)
                label = server.predict("big", inputs)["bucket"]
                facts = server.settle("big", label)
                for _ in range(3):
                    served_by = server.predict("big", inputs)["engine"]
                engines.append(served_by)
                measured = {name: round(ms, 2) for name, ms in (facts.get("latency_ms") or {}).items()}
                held = server.http.get("/models/big").json().get("weights") or {}
                sizes = {key: value for key, value in held.items() if key.endswith("bytes") and value is not None}
                mib = {key: round(value / 2**20) for key, value in sizes.items()}
                note = f"{facts['state']}, served by {served_by} {measured}; held (MiB): {mib}"
                rows.append((f"bucket {label}", server.rss() - start, note))
            compiles = server.compiles("big", "tvm")
            server.upload("big", retrained, config, replace=True)
            server.probed("big")
            for index, shapes in enumerate(buckets):
                label = server.predict("big", inputs_for(proto, shapes, index))["bucket"]
                server.settle("big", label)
            new_compiles = server.compiles("big", "tvm") - compiles
            rows.append(("new weights, same graph", server.rss() - start, f"{new_compiles:g} TVM compiles"))
            server.http.delete("/models/big").raise_for_status()
            time.sleep(3)
            rows.append(("after delete", server.rss() - start, ""))
        finally:
            process.terminate()
            process.wait(timeout=60)
    print(cpu_line())
    name = model_path or "synthetic 12-layer hidden-768 encoder"
    print(f"model: {name}; weights {weights / 2**20:.0f} MiB; {settings}")
    print("| step | RSS over the empty server (MiB) | x weights | |\n| --- | --- | --- | --- |")
    previous = 0.0
    for step, over, note in rows:
        change = "" if step == "after upload" else f" ({(over - previous) / weights:+.2f}x)"
        print(f"| {step} | {over / 2**20:,.0f} | {over / weights:.2f}x{change} | {note} |")
        previous = over
    result = {
        "weights_bytes": weights,
        "upload_seconds": round(upload_seconds, 2),
        "steps": {step: round(over / weights, 3) for step, over, _ in rows},
        "engines": engines,
        "new_weights_tvm_compiles": new_compiles,
    }
    print(json.dumps(result))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path, nargs="?", help="an ONNX model (default: the zoo's BERT-base)")
    parser.add_argument("--bucket", action="append", default=[], metavar="NAME=D0,D1,...")
    parser.add_argument("--openvino", choices=["0", "1"], default="1", help="JITSERVE_OPENVINO (default on)")
    args = parser.parse_args()
    model = args.model
    buckets = parse_buckets(args.bucket) if args.bucket else None
    if model is None:
        zoo = zoo_path("bert_base")
        model = zoo if zoo.exists() else None
        if buckets is None:
            buckets = BERT_BUCKETS if model else [{"x": (1, 128, 768)}, {"x": (2, 128, 768)}, {"x": (4, 128, 768)}]
    if buckets is None:
        parser.error("--bucket is needed with a model of your own")
    run(model, buckets, {"openvino": args.openvino})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
