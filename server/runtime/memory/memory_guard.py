"""Memory-aware admission: an upload whose weights cannot fit in the server's
memory beside what it serves is refused at once (507, naming the sizes),
rather than the server being killed for memory later, mid-compile or
mid-request, with every model it serves."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import psutil

from compiler.errors import InsufficientMemoryError
from compiler.models.memory import process_tree_resident_bytes

from ..observability.metrics import Metrics

UPLOAD_WEIGHT_FACTOR = 4.0
"""Memory an upload needs per byte of its weights at its peak, measured on a 419 MiB encoder (README,
Memory): the bytes, the parsed model and ONNX Runtime's session being built, 4.0x for a moment; then
1.2x served by ONNX Runtime, 2.2x once kernels map the weights too."""

CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


def detected_memory_limit() -> int:
    """The container's memory limit (cgroup v2, else v1), else the machine's memory."""
    machine = psutil.virtual_memory().total
    for path in CGROUP_LIMITS:
        with contextlib.suppress(OSError, ValueError):
            text = path.read_text().strip()
            if text != "max":
                return min(int(text), machine)  # v1 says "no limit" with a huge number
    return machine


class MemoryGuard:
    def __init__(self, limit_bytes: int | None, metrics: Metrics, weights_bytes: Callable[[], int]) -> None:
        """``limit_bytes`` None: the detected limit; 0: no check. ``weights_bytes``: the weights mapped now."""
        self.limit = detected_memory_limit() if limit_bytes is None else limit_bytes
        self.metrics = metrics
        metrics.memory.set_limit(limit=self.limit)
        metrics.before_scrape(lambda: metrics.memory.set_weights(total=weights_bytes()))

    def check_room(self, what: str, nbytes: int) -> None:
        """Refuse to build ``what`` (OpenVINO's compiled model) where its ``nbytes`` would take the server past
        its memory limit."""
        used = self._used_past(nbytes)
        if used is not None:
            mib = 2**20
            raise InsufficientMemoryError(
                f"no room for {what}: it needs about {nbytes / mib:.0f} MiB, the server holds {used / mib:.0f} MiB "
                f"of its {self.limit / mib:.0f} MiB (JITSERVE_MEMORY_BYTES)"
            )

    def check_upload(self, name: str, weight_bytes: int) -> None:
        """Refuse a model whose weights would take the server past its memory limit."""
        needed = int(UPLOAD_WEIGHT_FACTOR * weight_bytes)
        used = self._used_past(needed)
        if used is not None:
            mib = 2**20
            raise InsufficientMemoryError(
                f"model {name!r} does not fit in memory: its {weight_bytes / mib:.0f} MiB of weights need about "
                f"{needed / mib:.0f} MiB while it is loaded (its bytes, ONNX Runtime's session), the server holds "
                f"{used / mib:.0f} MiB of its {self.limit / mib:.0f} MiB (JITSERVE_MEMORY_BYTES); delete or unload "
                "a model, or give the server more memory"
            )

    def _used_past(self, needed: int) -> int | None:
        """What the server and its children hold where ``needed`` more would take them past the limit (the
        refusal counted); None where it fits, or there is no limit."""
        if not self.limit:
            return None
        used = sum(process_tree_resident_bytes())
        if used + needed <= self.limit:
            return None
        self.metrics.memory.record_refusal()
        return used
