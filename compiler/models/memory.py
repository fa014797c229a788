"""Tensor sizes checked before anything allocates them.

A model whose static dims (an input of 10^12 elements, a ``ConstantOfShape``
of 4 TB) or a config whose sizes (a probe size of 10^12) need a tensor past
the limit can never run: it is refused at upload, naming the tensor, instead
of failing at the first probe or request with an allocation error.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import onnx
import psutil

from ..errors import BadRequestError, InvalidModelError
from .signature import Signature
from .weights import weightless


def anonymous_resident_bytes() -> int:
    """This process's resident anonymous memory (heap, arenas; not mapped files such as libraries and
    weights), from ``/proc/self/status``; 0 where there is none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def release_mapped_file_pages(prefix: str) -> int:
    """Give back this process's resident pages of read-only shared mappings of files whose path starts with
    ``prefix`` (a later read faults them in from the file again; nothing written is lost, as nothing can
    be); returns the bytes of the mappings released."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    released = 0
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or fields[1] != "r--s" or not fields[5].startswith(prefix):
            continue
        low, high = (int(address, 16) for address in fields[0].split("-"))
        if libc.madvise(low, high - low, mmap.MADV_DONTNEED) == 0:
            released += high - low
    return released


def process_tree_resident_bytes() -> tuple[int, int]:
    """Resident bytes of this process, and of its children summed (those ending meanwhile skipped)."""
    process = psutil.Process()
    children = 0
    for child in process.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            children += child.memory_info().rss
    return process.memory_info().rss, children


def tensor_bytes(shape: Iterable[int], dtype: str | np.dtype) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize


def _static_shape(value: onnx.ValueInfoProto) -> tuple[int, ...] | None:
    """The shape when every dim is known, else None."""
    if value.type.WhichOneof("value") != "tensor_type" or not value.type.tensor_type.HasField("shape"):
        return None
    dims = value.type.tensor_type.shape.dim
    if not all(d.HasField("dim_value") for d in dims):
        return None
    return tuple(int(d.dim_value) for d in dims)


def _itemsize(elem_type: int) -> int:
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type)).itemsize
    except (KeyError, TypeError, ValueError):
        return 1  # string, float8, int4: at least a byte each


def largest_static_tensors(proto: onnx.ModelProto) -> list[tuple[str, int]]:
    """(name, bytes) of every tensor of the main graph whose shape ONNX shape inference (with constant
    propagation) fixes statically, inputs and outputs included, largest first."""
    try:
        inferred = onnx.shape_inference.infer_shapes(weightless(proto), data_prop=True)
    except (onnx.shape_inference.InferenceError, ValueError, RuntimeError):
        inferred = proto  # the checker already passed; what inference cannot fix goes unchecked
    graph = inferred.graph
    sizes = []
    for value in [*graph.input, *graph.value_info, *graph.output]:
        shape = _static_shape(value)
        if shape is not None:
            sizes.append((value.name, math.prod(shape) * _itemsize(value.type.tensor_type.elem_type)))
    return sorted(sizes, key=lambda item: -item[1])


def check_model_fits(proto: onnx.ModelProto, signature: Signature, limit: int) -> None:
    """422 when some input at its smallest (symbolic dims 1) or some static tensor is over ``limit`` bytes."""
    for spec in signature.inputs:
        smallest = tensor_bytes((d if isinstance(d, int) else 1 for d in spec.dims), spec.dtype)
        if smallest > limit:
            raise InvalidModelError(
                f"input {spec.name!r} with dims {list(spec.dims)} needs at least {smallest} bytes, "
                f"over the largest tensor served ({limit} bytes)"
            )
    for name, size in largest_static_tensors(proto)[:1]:
        if size > limit:
            raise InvalidModelError(
                f"tensor {name!r} needs {size} bytes, over the largest tensor served ({limit} bytes)"
            )


def check_sizes_fit(signature: Signature, sizes: dict[str, int], limit: int, what: str) -> None:
    """400 when the inputs at these axis sizes (a config's probe sizes, warm bucket, dynamic range)
    would hold a tensor over ``limit`` bytes."""
    for spec in signature.inputs:
        shape = [d if isinstance(d, int) else sizes.get(d, 1) for d in spec.dims]
        size = tensor_bytes(shape, spec.dtype)
        if size > limit:
            raise BadRequestError(
                f"config {what}: input {spec.name!r} would be {'x'.join(map(str, shape))} ({size} bytes), "
                f"over the largest tensor served ({limit} bytes)"
            )


def inputs_fit(signature: Signature, sizes: dict[str, int], limit: int) -> bool:
    try:
        check_sizes_fit(signature, sizes, limit, "")
    except BadRequestError:
        return False
    return True
