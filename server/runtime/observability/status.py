"""The server at a glance, for the console: readiness, the compile queue, memory and the kernel cache."""

from __future__ import annotations

import time

from compiler.models.memory import process_tree_resident_bytes

_STARTED = time.time()


def server_status(service) -> dict:
    """What ``GET /server`` answers (``service``: the :class:`~.service.ModelService`)."""
    ready, waiting = service.ready()
    server_rss, children_rss = process_tree_resident_bytes()
    settings, scheduler, cache = service.settings, service.scheduler, service.kernels.cache
    return {
        "ready": ready,
        "waiting": waiting,
        "uptime_seconds": round(time.time() - _STARTED, 1),
        "jit": service.jit_enabled,
        "tuning": settings.tuning_enabled,
        "routing": settings.routing,
        "compile_queue": {
            "queued": scheduler.queued,
            "running": scheduler.running,
            "queue_size": scheduler.queue_size,
            "workers": scheduler.workers,
        },
        "memory": {
            "server_bytes": server_rss,
            "children_bytes": children_rss,
            "weights_bytes": service.kernels.weights.total_bytes,
            "limit_bytes": service.admission.memory_guard.limit or None,
        },
        "store_check": service.metrics.kernels.store_checks,
        "kernel_cache": {
            "entries": len(cache),
            "max_entries": cache.max_entries,
            "bytes": cache.total_bytes,
            "max_bytes": cache.max_bytes,
        },
    }
