"""Whether the server builds OpenVINO: enabled by its setting and installed, for static CPU buckets."""

from __future__ import annotations

import pytest

from compiler.shapes.buckets import bucket_label
from compiler.storage.store import StagingArea
from server.runtime.compiling import openvino_builds
from server.runtime.compiling.openvino_builds import OpenVinoBuilds
from server.runtime.models.state import ServedBucket
from server.runtime.observability.metrics import Metrics
from server.settings import Settings


def _builds(tmp_path, **settings) -> OpenVinoBuilds:
    return OpenVinoBuilds(Settings(data_dir=tmp_path, **settings), Metrics(), StagingArea(tmp_path / "s"), threads=2)


def test_off_by_its_setting_or_where_the_package_is_missing(tmp_path, monkeypatch):
    pytest.importorskip("openvino")
    assert _builds(tmp_path, openvino=True).enabled
    assert not _builds(tmp_path, openvino=False).enabled
    monkeypatch.setattr(openvino_builds, "openvino_available", lambda: False)
    assert not _builds(tmp_path, openvino=True).enabled


class _Served:
    def __init__(self, kind: str) -> None:
        self.target = {"kind": kind}


@pytest.mark.parametrize(
    ("kind", "shapes", "taken"),
    [("llvm", {"x": (1, 8)}, True), ("cuda", {"x": (1, 8)}, False), ("llvm", {"x": (1, "seq")}, False)],
)
def test_built_for_static_cpu_buckets_alone(tmp_path, kind, shapes, taken):
    pytest.importorskip("openvino")
    bucket = ServedBucket(bucket_label(shapes), shapes, "k")
    assert _builds(tmp_path, openvino=True).takes(_Served(kind), bucket) is taken
