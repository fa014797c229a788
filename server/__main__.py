"""``python -m server``: run jitserve under uvicorn with settings from the environment."""

import logging
import sys

import uvicorn

from .app import create_app
from .settings import Settings


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings()
    try:
        app = create_app(settings)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="info",
        access_log=settings.access_log,
        timeout_graceful_shutdown=settings.shutdown_grace_seconds,
    )
    server = Server(config)
    server.run()
    return 0 if server.started else 3


class Server(uvicorn.Server):
    """uvicorn's server, stopping the gRPC server the moment it stops taking connections: both drain at once."""

    async def shutdown(self, sockets=None) -> None:
        grpc = getattr(self.config.app.state, "grpc", None)
        if grpc is not None:
            grpc.stop()
        await super().shutdown(sockets)


sys.exit(main())
