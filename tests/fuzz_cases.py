"""Hand-made hostile requests: malformed JSON, wrong types, huge and odd numbers, odd names, broken V2
binary framing, mutated models and configs. Deterministic for a seed; every case is one HTTP request
that a server must answer without a 5xx.

The targets are a model ``add`` (``y = x + x`` over ``x: float32[batch, 4]``) and the routes of both
protocols.
"""

from __future__ import annotations

import json
import random
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import quote

from tests import synthetic

MODEL = "add"
VALID_ROWS = [[1.0, 2.0, 3.0, 4.0], [0.5, -0.5, 0.0, 1e-3]]


@dataclass
class Case:
    kind: str
    method: str
    path: str
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    files: dict | None = None
    data: dict | None = None

    def describe(self) -> str:
        return f"{self.kind}: {self.method} {self.path} {self.body[:120]!r}"


ODD_STRINGS = [
    "", " ", "x" * 10_000, "\u0000", "\ud7ff\ue000", "💥", "../../etc/passwd", "%00", "x\ny", "NaN", "1e999",
    "\\u0000", "<script>", "' OR 1=1 --", "ⅹ", "x" * 65,
]  # fmt: skip
ODD_NUMBERS = [
    0, -1, 1, 2**31, 2**63, -(2**63) - 1, 10**30, 10**400, 1e308, -1e308, 5e-324, -0.0, 3.4e38, 3.5e38, 1e6, 1e7,
]  # fmt: skip


def random_json(rng: random.Random, depth: int = 0):
    """Any JSON value, small."""
    kinds = ["null", "bool", "int", "float", "str", "list", "dict"] if depth < 4 else ["null", "int", "str"]
    kind = rng.choice(kinds)
    if kind == "null":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.choice(ODD_NUMBERS) if rng.random() < 0.5 else rng.randint(-5, 5)
    if kind == "float":
        return rng.choice([1.5, -2.25, 1e-45, 1e38, 3.4028235e38])
    if kind == "str":
        return rng.choice(ODD_STRINGS)
    if kind == "list":
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["x", "y", "inputs", "model", "data", ""]): random_json(rng, depth + 1) for _ in range(3)}


def _dumps(value) -> bytes:
    # Python's json writes what orjson refuses (huge ints, NaN): both must be answered.
    return json.dumps(value, allow_nan=True).encode()


def _mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    data = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        choice = rng.random()
        position = rng.randrange(len(data) + 1)
        if choice < 0.3 and data:
            data[min(position, len(data) - 1)] = rng.randrange(256)
        elif choice < 0.55:
            data[position:position] = rng.choice([b"{", b"]", b",", b'"', b"\\", b"\xff", b"\x00", b"1e999", b"NaN"])
        elif choice < 0.8:
            del data[position : position + rng.randint(1, 8)]
        else:
            data = data[:position]
    return bytes(data)


def _rows(rng: random.Random):
    """x as the model wants it, or broken: ragged, wrong depth, wrong width, odd values."""
    choice = rng.randrange(9)
    if choice == 0:
        return [[1.0, 2.0], [1.0, 2.0, 3.0, 4.0]]  # ragged
    if choice == 1:
        return [1.0, 2.0, 3.0, 4.0]  # one level short
    if choice == 2:
        return [[[1.0, 2.0, 3.0, 4.0]]]  # one level deep
    if choice == 3:
        return [[rng.choice(ODD_NUMBERS)] * 4]
    if choice == 4:
        return [[random_json(rng, 3) for _ in range(4)]]
    if choice == 5:
        return []
    if choice == 6:
        return [[1.0] * rng.choice([0, 3, 5, 1000])]
    if choice == 7:
        return [[]] * rng.randint(1, 3)
    return [[1.0, 2.0, 3.0, 4.0]] * rng.choice([1, 63, 64, 65, 200])


def predict_cases(rng: random.Random, count: int) -> Iterator[Case]:
    for _ in range(count):
        path = rng.choice(["/predict", f"/models/{MODEL}/predict"])
        choice = rng.randrange(6)
        if choice == 0:
            body = _dumps(random_json(rng))
        elif choice == 1:
            body = _dumps({"model": rng.choice([MODEL, *ODD_STRINGS[:6], 7, None]), "inputs": random_json(rng)})
        elif choice == 2:
            body = _dumps({"model": MODEL, "inputs": {rng.choice(["x", "X", "y", "", "x "]): _rows(rng)}})
        elif choice == 3:
            body = _dumps({"model": MODEL, "inputs": {"x": _rows(rng), rng.choice(ODD_STRINGS): [1.0]}})
        elif choice == 4:
            body = _mutate_bytes(rng, _dumps({"model": MODEL, "inputs": {"x": VALID_ROWS}}))
        else:
            body = rng.choice(
                [b"[" * 100_000, b'{"inputs":' * 50_000, b"\xef\xbb\xbf{}", b"{" + b" " * 100_000, b"null"]
            )
        content_type = rng.choice(["application/json", "text/plain", "application/x-www-form-urlencoded", ""])
        headers = {"content-type": content_type} if content_type else {}
        yield Case("predict", "POST", path, body, headers)


V2_TYPES = ["FP32", "FP16", "FP64", "INT64", "INT8", "BOOL", "BYTES", "UINT8", "fp32", "FLOAT", "", "BF16"]


def _v2_tensor(rng: random.Random) -> dict:
    tensor = {
        "name": rng.choice(["x", "x", "y", "", "💥"]),
        "datatype": rng.choice(V2_TYPES),
        "shape": rng.choice([[1, 4], [2, 4], [4], [1, -4], [0, 4], [2**62, 4], [1, 4, 1], [], ["a"], [1.5, 4]]),
    }
    if rng.random() < 0.7:
        tensor["data"] = rng.choice([[1.0] * 4, [1.0] * 8, [[1.0, 2.0, 3.0, 4.0]], ["a"] * 4, [], [True] * 4, None])
    if rng.random() < 0.3:
        tensor["parameters"] = {"binary_data_size": rng.choice([0, 16, 17, -1, 2**40, "16"])}
    return tensor


def v2_cases(rng: random.Random, count: int) -> Iterator[Case]:
    for _ in range(count):
        version = rng.choice(["", "", "/versions/1", "/versions/2", "/versions/-1", "/versions/x"])
        path = f"/v2/models/{MODEL}{version}/infer"
        header = {"inputs": [_v2_tensor(rng) for _ in range(rng.choice([0, 1, 1, 2]))]}
        if rng.random() < 0.3:
            header["outputs"] = [{"name": rng.choice(["y", "z", ""]), "parameters": random_json(rng, 3)}]
        if rng.random() < 0.3:
            header["parameters"] = random_json(rng, 3)
        encoded = _dumps(header)
        choice = rng.randrange(4)
        headers: dict[str, str] = {}
        if choice == 0:
            body = encoded
        elif choice == 1:
            body = _mutate_bytes(rng, encoded)
        else:
            # binary framing: a JSON header of some length, then raw bytes
            raw = struct.pack("<4f", 1.0, 2.0, 3.0, 4.0) * rng.choice([0, 1, 2])
            body = encoded + raw
            length = rng.choice(
                [len(encoded), len(encoded), 0, -1, len(body) + 1, 2**63, "abc", "", "+1", "0x10", "1e3"]
            )
            headers = {"inference-header-content-length": str(length), "content-type": "application/octet-stream"}
        yield Case("v2", "POST", path, body, headers)


def name_cases(rng: random.Random, count: int) -> Iterator[Case]:
    names = [*ODD_STRINGS[5:], ".staging", ".hidden", "...", "con", "NUL.txt", "a" * 300, "%2e%2e", "a%2Fb", "a b"]
    routes = [
        ("GET", "/models/{}"), ("DELETE", "/models/{}"), ("POST", "/models/{}/predict"), ("GET", "/v2/models/{}"),
        ("GET", "/v2/models/{}/ready"), ("POST", "/v2/models/{}/infer"), ("POST", "/v2/repository/models/{}/load"),
        ("POST", "/v2/repository/models/{}/unload"), ("PUT", "/models/{}"),
    ]  # fmt: skip
    for _ in range(count):
        method, template = rng.choice(routes)
        name = rng.choice(names)
        name = name if "%" in name else quote(name, safe="")  # those with % are sent encoded on purpose
        body = synthetic.add_model() if method == "PUT" else _dumps({"inputs": {"x": VALID_ROWS}})
        yield Case("name", method, template.format(name), body)


def _config(rng: random.Random):
    choice = rng.randrange(5)
    if choice == 0:
        return random_json(rng)
    axis = {"kind": rng.choice(["pow2", "exact", "multiple", "dynamic", "bogus", 3])}
    for key in rng.sample(["min", "max", "step", "sizes"], rng.randint(0, 3)):
        axis[key] = rng.choice([*ODD_NUMBERS, "8", None, [1, 2]])
    config = {"axes": {rng.choice(["batch", "x:0", "", "nope"]): axis}}
    if choice >= 2:
        config["warm_buckets"] = [{"x": rng.choice([[1, 4], [0, 4], [-1, 4], [10**12, 4], [1], "x", [1, 4, 4]])}]
    if choice >= 3:
        config["probe_sizes"] = {rng.choice(["batch", "x:0"]): rng.choice([[1, 2], [10**12], [-3], "all", [0]])}
    if choice == 4:
        config[rng.choice(["target", "rtol", "atol", "dynamic_batching", "unknown"])] = random_json(rng, 2)
    return config


def upload_cases(rng: random.Random, count: int) -> Iterator[Case]:
    model = synthetic.add_model()
    for index in range(count):
        name = f"fz{index % 4}"
        choice = rng.randrange(3)
        if choice == 0:
            yield Case("upload-model", "PUT", f"/models/{name}?replace=true", _mutate_bytes(rng, model))
        elif choice == 1:
            text = json.dumps(_config(rng))
            if rng.random() < 0.3:
                text = _mutate_bytes(rng, text.encode()).decode("latin-1")
            yield Case(
                "upload-config", "PUT", f"/models/{name}?replace=true",
                files={"model": ("model.onnx", model)}, data={"config": text},
            )  # fmt: skip
        else:
            parts = rng.choice([{"config": ("c.json", b"{}")}, {"model": ("m.onnx", b"")}, {"data": ("w", b"123")}])
            yield Case("upload-multipart", "PUT", f"/models/{name}", files=parts)


def all_cases(seed: int, *, predicts: int, v2: int, names: int, uploads: int) -> list[Case]:
    rng = random.Random(seed)
    return [
        *predict_cases(rng, predicts),
        *v2_cases(rng, v2),
        *name_cases(rng, names),
        *upload_cases(rng, uploads),
    ]
