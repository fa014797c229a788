"""KernelCache: LRU bounded by entries and by bytes."""

from __future__ import annotations

from server.runtime.memory.kernel_cache import KernelCache


class _Kernel:
    name = "tvm"

    def run(self, inputs):
        return inputs


def test_evicts_least_recently_used_past_max_entries():
    evicted = []
    cache = KernelCache(2, 1 << 30, on_evict=evicted.append)
    a, b, c = _Kernel(), _Kernel(), _Kernel()
    cache.put("a", a, 10)
    cache.put("b", b, 10)
    assert cache.get("a") is a  # a is now the most recent
    cache.put("c", c, 10)
    assert evicted == ["b"]
    assert cache.get("b") is None
    assert cache.get("a") is a and cache.get("c") is c
    assert len(cache) == 2 and cache.total_bytes == 20


def test_evicts_past_max_bytes_but_keeps_the_newest():
    evicted = []
    cache = KernelCache(10, 100, on_evict=evicted.append)
    cache.put("a", _Kernel(), 60)
    cache.put("b", _Kernel(), 60)
    assert evicted == ["a"]
    cache.put("huge", _Kernel(), 500)  # alone over the limit: still kept
    assert evicted == ["a", "b"]
    assert "huge" in cache and cache.total_bytes == 500


def test_put_same_key_replaces_without_double_counting():
    cache = KernelCache(4, 1000)
    cache.put("a", _Kernel(), 100)
    cache.put("a", _Kernel(), 300)
    assert len(cache) == 1 and cache.total_bytes == 300
    cache.discard("a")
    assert len(cache) == 0 and cache.total_bytes == 0
