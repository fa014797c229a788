"""The model store shared by several processes (replicas on one volume):
version numbers and bucket records stay whole under concurrent writers."""

from __future__ import annotations

import subprocess
import sys
import time

from compiler.models.model import model_digest
from server.runtime.models.records import BucketRecord, ModelConfig, ModelRecord, ModelStore

DATA = b"model bytes"
WRITERS, EACH = 4, 10

WRITE = """
import sys
from server.runtime.models.records import BucketRecord, ModelStore
from tests.server.runtime.test_records import record
store, what, writer = ModelStore(sys.argv[1]), sys.argv[2], sys.argv[3]
for i in range(int(sys.argv[4])):
    if what == "versions":
        with store.locked():
            store.save(record((store.latest_version("m") or 0) + 1), b"model bytes")
    else:
        mine = record(store.latest_version("m"))
        label = f"x={writer}x{i}"
        mine.buckets[label] = BucketRecord(key=label, model_version=mine.version, route="tvm")
        store.update_bucket(mine, label)
"""


def record(version: int) -> ModelRecord:
    return ModelRecord(
        name="m", version=version, digest=model_digest(DATA), config=ModelConfig(), safety={}, created_at=time.time()
    )


def run_writers(root, what: str) -> None:
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITE, str(root), what, str(index), str(EACH)])
        for index in range(WRITERS)
    ]
    assert [writer.wait(120) for writer in writers] == [0] * WRITERS


def test_concurrent_writers_never_take_one_version_or_lose_a_bucket_record(tmp_path):
    store = ModelStore(tmp_path)
    run_writers(tmp_path, "versions")
    assert store.current_versions() == {"m": WRITERS * EACH}  # every save took the next number
    assert [entry.name for entry in (tmp_path / "m").iterdir()] == [f"v{WRITERS * EACH}"]

    run_writers(tmp_path, "buckets")
    loaded, data = store.load("m")
    assert data == DATA
    assert sorted(loaded.buckets) == sorted(f"x={w}x{i}" for w in range(WRITERS) for i in range(EACH))


def test_a_bucket_record_for_a_replaced_version_is_dropped(tmp_path):
    store = ModelStore(tmp_path)
    with store.locked():
        store.save(record(1), DATA)
        store.save(record(2), DATA)
    old = record(1)
    old.buckets["x=1x4"] = BucketRecord(key="k", model_version=1)
    store.update_bucket(old, "x=1x4")
    assert store.load("m")[0].buckets == {}
    assert not (tmp_path / "m" / "v1").exists()
