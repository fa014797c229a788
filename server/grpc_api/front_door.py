"""The gRPC server's life: started after the app's startup on the same event loop, stopped with the
HTTP server (new calls refused at once, calls in flight given the shutdown grace)."""

from __future__ import annotations

import asyncio
import logging

import grpc

from ..runtime.observability.metrics import Metrics
from ..runtime.service import ModelService
from ..settings import Settings
from .messages import SERVICE, method_handlers
from .servicer import InferenceServicer

log = logging.getLogger("jitserve")


def listen_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class GrpcFrontDoor:
    """The gRPC server over the runtime the REST app serves from."""

    def __init__(self, settings: Settings, service: ModelService, metrics: Metrics) -> None:
        self.settings = settings
        self.server = grpc.aio.server(
            options=[
                # The REST infer body's limit is the message's: bigger ones end RESOURCE_EXHAUSTED unread.
                ("grpc.max_receive_message_length", settings.max_infer_bytes),
                ("grpc.max_send_message_length", -1),
                # gRPC shares a port with another process by default: a second server would start silently.
                ("grpc.so_reuseport", 0),
            ]
        )
        self.server.add_registered_method_handlers(
            SERVICE, method_handlers(InferenceServicer(service, metrics, settings.admin_token))
        )
        self._stopping: asyncio.Future | None = None

    async def start(self) -> None:
        address = listen_address(self.settings.host, self.settings.grpc_port)
        try:
            self.server.add_insecure_port(address)
        except RuntimeError as exc:
            raise RuntimeError(f"gRPC cannot listen on {address}: {exc}") from None
        await self.server.start()
        log.info("gRPC (inference.GRPCInferenceService) on %s", address)

    def stop(self) -> asyncio.Future:
        """Refuse new calls now and give the ones in flight the shutdown grace; the same stop each time."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self.server.stop(self.settings.shutdown_grace_seconds))
        return self._stopping
