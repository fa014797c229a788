"""The protocol's messages and methods, built from ``inference.proto`` (compiled by ``make proto`` into
``inference.binpb``, a descriptor set) in a descriptor pool of their own: a process that also imports
another definition of ``inference.*`` (tritonclient's, KServe's) keeps both."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

SERVICE = "inference.GRPCInferenceService"
DESCRIPTOR_SET = Path(__file__).with_name("inference.binpb")

POOL = descriptor_pool.DescriptorPool()
for _file in descriptor_pb2.FileDescriptorSet.FromString(DESCRIPTOR_SET.read_bytes()).file:
    POOL.Add(_file)


def _message(name: str) -> type:
    return message_factory.GetMessageClass(POOL.FindMessageTypeByName(f"inference.{name}"))


ServerLiveResponse = _message("ServerLiveResponse")
ServerReadyResponse = _message("ServerReadyResponse")
ModelReadyResponse = _message("ModelReadyResponse")
ServerMetadataResponse = _message("ServerMetadataResponse")
ModelMetadataResponse = _message("ModelMetadataResponse")
ModelInferRequest = _message("ModelInferRequest")
ModelInferResponse = _message("ModelInferResponse")
RepositoryIndexResponse = _message("RepositoryIndexResponse")
RepositoryModelLoadResponse = _message("RepositoryModelLoadResponse")
RepositoryModelUnloadResponse = _message("RepositoryModelUnloadResponse")


@dataclass(frozen=True)
class MalformedMessage:
    """A request that does not parse as its message: handed to the method, which answers INVALID_ARGUMENT
    (gRPC itself answers a parser's exception with INTERNAL, as if the server were at fault)."""

    message: str
    problem: str


def _parser(message_class: type):
    def parse(data: bytes):
        try:
            return message_class.FromString(data)
        except DecodeError as exc:
            return MalformedMessage(message_class.DESCRIPTOR.name, str(exc))

    return parse


def method_handlers(servicer: object) -> dict[str, grpc.RpcMethodHandler]:
    """Every method of the service, answered by the servicer's coroutine of the same name."""
    return {
        method.name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, method.name),
            request_deserializer=_parser(message_factory.GetMessageClass(method.input_type)),
            response_serializer=message_factory.GetMessageClass(method.output_type).SerializeToString,
        )
        for method in POOL.FindServiceByName(SERVICE).methods
    }
