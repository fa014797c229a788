"""``python -m server`` (and ``jitserve serve``): run jitserve under uvicorn, with settings from the
environment (``JITSERVE_*``) and from flags (``--port 8080``: every setting is one, ``--help`` lists them)."""

import logging
import sys

import uvicorn
from pydantic import ValidationError

from .app import create_app
from .settings import Settings


def serve(argv: list[str], *, prog: str = "python -m server") -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = Settings(_cli_parse_args=argv, _cli_kebab_case=True, _cli_prog_name=prog)
        app = create_app(settings)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}" for e in exc.errors())
        print(f"error: {problems}", file=sys.stderr)
        return 2
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


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1:]))
