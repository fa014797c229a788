"""Compile targets as canonical JSON dicts (TVM rejects the string form).

LLVM without ``mcpu`` emits baseline x86-64 (no AVX2/FMA), so the host CPU
is detected through LLVM. The answer is cached per CPU fingerprint so that a
process that only looks up the artifact store need not import TVM.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from pathlib import Path

# Attributes the ``nvidia/...`` tags set: dlight and MetaSchedule read them.
_CUDA_LIMITS = {"max_threads_per_block": 1024, "max_shared_memory_per_block": 49152, "thread_warp_size": 32}


def _cpu_fingerprint() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    wanted = [line for line in text.splitlines() if line.startswith(("model name", "flags", "vendor_id"))]
    return hashlib.sha256("\n".join(sorted(set(wanted))).encode()).hexdigest()[:16]


@lru_cache(maxsize=1)
def host_cpu() -> str:
    """LLVM's name for the host CPU (e.g. ``znver3``), cached on disk."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jitserve" / "host-cpu.json"
    fingerprint = _cpu_fingerprint()
    try:
        cached = json.loads(cache.read_text())
        if cached.get("fingerprint") == fingerprint:
            return cached["mcpu"]
    except (OSError, ValueError, KeyError):
        pass
    import tvm.target.codegen  # only on a cache miss: importing TVM costs ~1 s

    mcpu = str(tvm.target.codegen.llvm_get_system_cpu())
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"fingerprint": fingerprint, "mcpu": mcpu}))
        tmp.replace(cache)
    except OSError:
        pass
    return mcpu


def host_cores() -> int:
    """CPU cores this process may run on (its affinity mask, not the host's count)."""
    return len(os.sched_getaffinity(0))


def resolve_target(name: str, *, cuda_arch: str = "sm_90", num_cores: int | None = None) -> dict:
    """``llvm``, ``cuda`` or a JSON target dict -> a complete target dict."""
    if name.strip().startswith("{"):
        try:
            target = json.loads(name)
        except ValueError as exc:
            raise ValueError(f"target is not valid JSON: {exc}") from None
        if not isinstance(target, dict) or "kind" not in target:
            raise ValueError("a JSON target needs a 'kind'")
        return target
    llvm = {"kind": "llvm", "mcpu": host_cpu(), "num-cores": num_cores or host_cores()}
    if name == "llvm":
        return llvm
    if name == "cuda":
        return {"kind": "cuda", "arch": cuda_arch, **_CUDA_LIMITS, "host": llvm}
    raise ValueError(f"unknown target {name!r}: use llvm, cuda or a JSON target dict")


def canonical_target(target: dict) -> str:
    return json.dumps(target, sort_keys=True, separators=(",", ":"))


def target_kind(target: dict) -> str:
    return str(target["kind"])
