"""Replicas on one store: kernels built by a peer, build leases taken over, uploads followed."""

from __future__ import annotations

from functools import partial

from prometheus_client import CollectorRegistry, Counter, Histogram

from .compiles import COMPILE_BUCKETS


class FleetMetrics:
    """The metrics of replicas sharing one store: builds waited for, leases taken over, changes followed."""

    def __init__(self, registry: CollectorRegistry) -> None:
        counter, histogram = (partial(kind, registry=registry) for kind in (Counter, Histogram))
        self.peer_builds = counter(
            "jitserve_kernels_built_by_peers_total",
            "Kernels this replica waited for while another process on the shared store built them (by tier).",
            ["tier"],
        )
        self.peer_wait = histogram(
            "jitserve_peer_build_wait_seconds",
            "How long a compile waited for another process on the shared store to build the same kernel.",
            buckets=COMPILE_BUCKETS,
        )
        self.lease_takeovers = counter(
            "jitserve_compile_lease_takeovers_total",
            "Kernels built here after the process holding their build lease ended without one (died or failed).",
        )
        self.store_follows = counter(
            "jitserve_model_store_follows_total",
            "Changes another replica made to the shared model store that this one followed "
            "(new_model, new_version, deleted).",
            ["change"],
        )
        for tier in ("tvm", "tvm-tuned"):  # zero before the first one: a dashboard shows 0, not "no data"
            self.peer_builds.labels(tier)
        for change in ("new_model", "new_version", "deleted"):
            self.store_follows.labels(change)

    def record_peer_build(self, *, tier: str, seconds: float) -> None:
        self.peer_builds.labels(tier).inc()
        self.peer_wait.observe(seconds)

    def record_lease_takeover(self) -> None:
        self.lease_takeovers.inc()

    def record_store_follow(self, *, change: str) -> None:
        self.store_follows.labels(change).inc()
