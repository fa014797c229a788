"""What the Open Inference Protocol's two front doors (REST in :mod:`server.v2`, gRPC in
:mod:`server.grpc_api`) answer alike: the server's and a model's metadata, and the version a call names."""

from __future__ import annotations

from importlib.metadata import version as package_version

from compiler.errors import NotFoundError

from .runtime.models.registry import ServedModel
from .runtime.service import ModelService
from .v2_codec import v2_datatype

EXTENSIONS = ["binary_tensor_data", "model_repository"]


def served_version(service: ModelService, name: str, version: str | None) -> ServedModel:
    """The model ``name`` as served; 404 when it is not served, or ``version`` (None: any) is not the one served."""
    served = service.get(name)
    if version is not None and version != str(served.record.version):
        raise NotFoundError(f"model {name!r} has no version {version!r}; it serves version {served.record.version}")
    return served


def server_metadata() -> dict:
    return {"name": "jitserve", "version": package_version("jitserve"), "extensions": EXTENSIONS}


def tensor_metadata(specs) -> list[dict]:
    """Inputs' or outputs' names, datatypes and shapes (-1: a variable size)."""
    return [
        {"name": s.name, "datatype": v2_datatype(s.dtype), "shape": [d if isinstance(d, int) else -1 for d in s.dims]}
        for s in specs
    ]


def model_metadata(served: ServedModel) -> dict:
    signature = served.model.signature
    return {
        "name": served.name,
        "versions": [str(served.record.version)],
        "platform": "onnx",
        "inputs": tensor_metadata(signature.inputs),
        "outputs": tensor_metadata(signature.outputs),
    }
