"""Uploads as files: external data read in and checked, archives unpacked safely."""

from __future__ import annotations

import io
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest

from compiler.errors import BadRequestError, InvalidModelError, PayloadTooLargeError
from compiler.models.upload import UPLOAD_MODEL_NAME, load_upload, load_upload_folder
from compiler.running.engines import OrtEngine
from tests import synthetic

MAX = 1 << 30


def save_with_external_data(folder: Path, data: bytes, location: str = "model.onnx.data") -> Path:
    """The model as ``onnx.save(..., save_as_external_data=True)`` writes it: model.onnx + one data file."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    onnx.save(
        onnx.load_from_string(data),
        path,
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=location,
        size_threshold=0,
    )
    return path


def outputs_match(model, data: bytes) -> None:
    inputs = {"a": np.ones((2, 8), np.float32), "b": np.full((2, 8), 2, np.float32)}
    np.testing.assert_array_equal(OrtEngine(model.data).run(inputs)["y"], OrtEngine(data).run(inputs)["y"])


def test_external_data_is_read_into_a_self_contained_model(tmp_path):
    data = synthetic.two_input_model()
    path = save_with_external_data(tmp_path / "up", data)
    assert (tmp_path / "up" / "model.onnx.data").stat().st_size > 0
    model = load_upload(path, tmp_path / "up", max_bytes=MAX)
    assert not any(t.external_data for t in model.proto.graph.initializer)
    outputs_match(model, data)


@pytest.mark.parametrize(
    ("location", "message"),
    [("../secret.bin", "outside the upload"), ("/etc/passwd", "outside the upload"), ("gone.bin", "'data' part")],
)
def test_locations_must_stay_inside_the_upload_and_exist(tmp_path, location, message):
    (tmp_path / "secret.bin").write_bytes(b"\0" * 4096)
    path = save_with_external_data(tmp_path / "up", synthetic.two_input_model())
    proto = onnx.load(path, load_external_data=False)
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    path.write_bytes(proto.SerializeToString())
    with pytest.raises(InvalidModelError, match=message):
        load_upload(path, tmp_path / "up", max_bytes=MAX)


def test_bytes_past_the_end_of_the_file_are_refused(tmp_path):
    path = save_with_external_data(tmp_path / "up", synthetic.two_input_model())
    data_file = tmp_path / "up" / "model.onnx.data"
    data_file.write_bytes(data_file.read_bytes()[:10])
    with pytest.raises(InvalidModelError, match="reads bytes"):
        load_upload(path, tmp_path / "up", max_bytes=MAX)


def archive(kind: str, files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    if kind == "zip":
        with zipfile.ZipFile(buffer, "w") as bundle:
            for name, content in files.items():
                bundle.writestr(name, content)
    else:
        with tarfile.open(fileobj=buffer, mode="w:gz") as bundle:
            for name, content in files.items():
                info = tarfile.TarInfo(name)
                info.size = len(content)
                bundle.addfile(info, io.BytesIO(content))
            link = tarfile.TarInfo("exported/link.bin")
            link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
            bundle.addfile(link)
    return buffer.getvalue()


def model_folder_files(tmp_path: Path) -> dict[str, bytes]:
    save_with_external_data(tmp_path / "src", synthetic.two_input_model())
    return {f"exported/{p.name}": p.read_bytes() for p in (tmp_path / "src").iterdir()}


@pytest.mark.parametrize("kind", ["zip", "tar"])
def test_an_archive_of_the_model_folder(tmp_path, kind):
    folder = tmp_path / "upload"
    folder.mkdir()
    (folder / UPLOAD_MODEL_NAME).write_bytes(archive(kind, model_folder_files(tmp_path)))
    model = load_upload_folder(folder, max_bytes=MAX)
    outputs_match(model, synthetic.two_input_model())
    assert not (folder / "unpacked" / "exported" / "link.bin").exists()  # links are never followed


@pytest.mark.parametrize(
    ("files", "error", "message"),
    [
        ({"../evil.onnx": b"x"}, BadRequestError, "relative path inside the upload"),
        ({"a.onnx": b"x", "b.onnx": b"y"}, BadRequestError, "exactly one .onnx file"),
        ({"notes.txt": b"x"}, BadRequestError, "found none"),
        ({"model.onnx": b"\0" * 5000}, PayloadTooLargeError, "unpacks to more than the limit of 4096"),
    ],
)
def test_bad_archives_are_refused(tmp_path, files, error, message):
    folder = tmp_path / "upload"
    folder.mkdir()
    (folder / UPLOAD_MODEL_NAME).write_bytes(archive("zip", files))
    with pytest.raises(error, match=message):
        load_upload_folder(folder, max_bytes=4096)


def test_a_plain_upload_is_loaded_as_before(tmp_path):
    folder = tmp_path / "upload"
    folder.mkdir()
    (folder / UPLOAD_MODEL_NAME).write_bytes(synthetic.two_input_model())
    outputs_match(load_upload_folder(folder, max_bytes=MAX), synthetic.two_input_model())
    (folder / UPLOAD_MODEL_NAME).write_bytes(b"")
    with pytest.raises(InvalidModelError, match="empty"):
        load_upload_folder(folder, max_bytes=MAX)
