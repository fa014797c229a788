"""An uploaded model as files: one ONNX file, and the external data files it
names (``onnx.save(..., save_as_external_data=True)``, the dynamo exporter's
``model.onnx.data``), sent side by side or as a ``.zip``/``.tar`` of the
model folder.

Every location a tensor names must stay inside the upload and its bytes
inside the file; the data is then read into the model, which from there on
is one self-contained proto (protobuf caps that at 2 GiB).
"""

from __future__ import annotations

import dataclasses
import shutil
import tarfile
import zipfile
from pathlib import Path, PurePosixPath

import onnx

from ..errors import BadRequestError, InvalidModelError, PayloadTooLargeError
from ..storage.store import StagingArea
from .model import LoadedModel, all_tensors, load_model, parse_model, validate_model

ZIP_MAGIC = b"PK\x03\x04"
TOKENIZER_NAME = "tokenizer.json"
"""A Hugging Face tokenizer beside the .onnx file of an archive upload: generate then takes text."""
UPLOAD_MODEL_NAME = "model.upload"  # the uploaded model file (or archive) inside its upload folder
COPY_CHUNK = 1 << 20


def safe_relative_path(name: str) -> PurePosixPath:
    """A relative path that stays inside its folder, or a 400 naming it."""
    path = PurePosixPath(name.replace("\\", "/"))
    if not name or path.is_absolute() or ".." in path.parts or any(":" in part for part in path.parts):
        raise BadRequestError(f"file name {name!r} must be a relative path inside the upload")
    return path


def is_archive(path: Path) -> bool:
    with open(path, "rb") as handle:
        head = handle.read(4)
    return head == ZIP_MAGIC or tarfile.is_tarfile(path)


def extract_archive(archive: Path, destination: Path, max_bytes: int) -> None:
    """Unpack the regular files of a zip or tar into ``destination``; at most ``max_bytes`` in all."""
    written = 0

    def copy(source, name: str) -> None:
        nonlocal written
        target = destination / safe_relative_path(name)
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "wb") as out:
            while chunk := source.read(COPY_CHUNK):
                written += len(chunk)
                if written > max_bytes:
                    raise PayloadTooLargeError(f"the archive unpacks to more than the limit of {max_bytes} bytes")
                out.write(chunk)

    try:
        if zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as bundle:
                for member in bundle.infolist():
                    if not member.is_dir():
                        with bundle.open(member) as source:
                            copy(source, member.filename)
        else:
            with tarfile.open(archive) as bundle:
                for member in bundle:
                    if member.isfile():  # links and devices are never followed
                        copy(bundle.extractfile(member), member.name)
    except (zipfile.BadZipFile, tarfile.TarError, EOFError) as exc:
        raise InvalidModelError(f"the archive is damaged: {exc}") from None


def find_model_file(folder: Path) -> Path:
    found = sorted(p for p in folder.rglob("*.onnx") if p.is_file())
    if len(found) != 1:
        names = [str(p.relative_to(folder)) for p in found]
        raise BadRequestError(f"an archive upload must hold exactly one .onnx file; found {names or 'none'}")
    return found[0]


def _read_external(tensor: onnx.TensorProto, base: Path, folder: Path) -> None:
    info = {entry.key: entry.value for entry in tensor.external_data}
    location = info.get("location", "")
    try:
        relative = safe_relative_path(location)
    except BadRequestError:
        raise InvalidModelError(
            f"tensor {tensor.name!r} references external data at {location!r}, outside the upload"
        ) from None
    path = (base / relative).resolve()
    if not path.is_relative_to(folder.resolve()) or not path.is_file():
        raise InvalidModelError(
            f"tensor {tensor.name!r} references external data {location!r} that is not in the upload: "
            f"send it as a multipart 'data' part with the file name {location!r}, or upload a .zip/.tar "
            "of the model folder"
        )
    try:
        offset, length = int(info.get("offset", 0)), int(info.get("length", -1))
    except ValueError:
        raise InvalidModelError(f"tensor {tensor.name!r} has a non-integer external data offset or length") from None
    size = path.stat().st_size
    length = size - offset if length < 0 else length
    if offset < 0 or offset + length > size:
        raise InvalidModelError(
            f"tensor {tensor.name!r} reads bytes {offset}..{offset + length} of {location!r}, which has {size}"
        )
    with open(path, "rb") as handle:
        handle.seek(offset)
        tensor.raw_data = handle.read(length)
    del tensor.external_data[:]
    tensor.data_location = onnx.TensorProto.DEFAULT


def load_upload(model_file: Path, folder: Path, *, max_bytes: int) -> LoadedModel:
    """The model in ``model_file`` with the external data it names read from ``folder``, validated."""
    size = model_file.stat().st_size
    if size > max_bytes:
        raise PayloadTooLargeError(f"model is {size} bytes, over the limit of {max_bytes}")
    data = model_file.read_bytes()
    proto = parse_model(data, max_bytes=max_bytes)
    external = [t for t in all_tensors(proto) if t.data_location == onnx.TensorProto.EXTERNAL or t.external_data]
    if not external:
        return validate_model(proto, data)
    del data
    for tensor in external:
        _read_external(tensor, model_file.parent, folder)
    if proto.ByteSize() > max_bytes:
        raise PayloadTooLargeError(f"model with its external data is over the limit of {max_bytes} bytes")
    return validate_model(proto, proto.SerializeToString())


def load_upload_folder(folder: Path, *, max_bytes: int) -> LoadedModel:
    """The model an upload folder holds: its model file with the data files beside it, or an archive."""
    model_file, root = folder / UPLOAD_MODEL_NAME, folder
    if model_file.is_file() and model_file.stat().st_size and is_archive(model_file):
        root = folder / "unpacked"
        extract_archive(model_file, root, max_bytes)
        model_file = find_model_file(root)
    if not model_file.is_file():
        return load_model(b"", max_bytes=max_bytes)
    model = load_upload(model_file, root, max_bytes=max_bytes)
    tokenizer = model_file.parent / TOKENIZER_NAME
    if root is folder or not tokenizer.is_file():
        return model
    return dataclasses.replace(model, tokenizer=checked_tokenizer(tokenizer.read_bytes()))


def checked_tokenizer(data: bytes) -> bytes:
    """``data`` where it is a Hugging Face ``tokenizer.json`` the ``tokenizers`` package reads; else 400."""
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_str(data.decode())
    except Exception as exc:  # noqa: BLE001 - it raises its own types, and UnicodeDecodeError
        raise BadRequestError(f"{TOKENIZER_NAME}: not a tokenizer the tokenizers package reads: {exc}") from None
    return data


def remove_upload(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def upload_folder(staging: StagingArea) -> Path:
    """A private folder for one upload (removed by :func:`remove_upload`, or swept once its process
    is gone)."""
    folder = staging.entry("upload")
    folder.mkdir()
    return folder
