"""jitserve's long-running process: thin HTTP adapters over the runtime in :mod:`server.runtime`."""
