"""KV caches in their freshly built state, recycled from episodes that are done with them."""

from __future__ import annotations

import torch

from zeroer.cache.layout import CacheSpec, KVCache, build_cache


class CachePool:
    """KV caches in their freshly built state, recycled from episodes that are done with them.

    Building a cache (guarded buffers, typed views, the segment table: dozens of small torch
    calls) took 4 to 7% of a simulator campaign's time, once per example and once per
    reallocation, so the fuzzer's episodes share a pool. A cache goes back only once its
    episode's simulated runtime has run every queued op and closed (:meth:`Episode.close`), so
    nothing can still write to it, and comes out with its buffers restored word for word to
    what ``build_cache`` makes (guards, poisoned pages): no state passes from one example to the
    next. Only the addresses repeat, which nothing may rely on (a fresh cache's are arbitrary
    too).
    """

    def __init__(self) -> None:
        self._free: dict[tuple[CacheSpec, str], list[KVCache]] = {}
        self._pristine: dict[tuple[CacheSpec, str], list[torch.Tensor]] = {}  # build_cache's words

    def take(self, spec: CacheSpec, device: torch.device) -> KVCache:
        key = (spec, str(device))
        free = self._free.get(key)
        if not free:
            cache = build_cache(spec, device=device)
            self._pristine.setdefault(key, [raw.clone() for raw in cache.raws])
            return cache
        cache = free.pop()
        for raw, pristine in zip(cache.raws, self._pristine[key]):
            raw.copy_(pristine)
        return cache

    def give(self, caches: list[KVCache]) -> None:
        for cache in caches:
            self._free.setdefault((cache.spec, str(cache.device)), []).append(cache)
