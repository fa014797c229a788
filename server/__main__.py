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
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level="info",
        access_log=settings.access_log,
        timeout_graceful_shutdown=settings.shutdown_grace_seconds,
    )
    return 0


sys.exit(main())
