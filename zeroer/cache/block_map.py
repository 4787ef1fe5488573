"""Which logical blocks of a KV cache a run of bytes meets.

The fuzzer's caller declares its own accesses to the cache by logical block (``("block", cache,
id)`` to the happens-before checker). Code under test that moves whole blocks (an offloader's
device-to-host store, its load back) touches the cache through tensor views, so its accesses arrive
as byte runs. This map turns those runs into the logical blocks they meet, so both sides of a race
are named by the same key. A run that meets only guard words or row padding meets no block (the
guard check reports a write there).

Example::

    blocks = CacheBlockMap(cache)
    kv = cache.layer_tensors["model.layers.0.self_attn.attn"]
    blocks.of_runs(byte_runs(kv[:, 3]))        # {3}: K and V of block 3 (tiny: one kernel block per block)
"""

from __future__ import annotations

from collections.abc import Iterable

from zeroer.cache.layout import WORD_BYTES, KVCache


class CacheBlockMap:
    """See the module docstring. Reads the cache's buffers at each call (a moved cache is followed)."""

    def __init__(self, cache: KVCache) -> None:
        self._cache = cache

    def _parts(self) -> list[tuple[int, int, int]]:
        """(first byte, row bytes, kernel blocks) of every part of every tensor."""
        cache = self._cache
        parts = []
        for t, tensor in enumerate(cache.spec.tensors):
            base = cache.raws[t].data_ptr()
            for part in range(tensor.parts):
                start = base + cache._part_start(tensor, part) * WORD_BYTES
                parts.append((start, tensor.row_words * WORD_BYTES, cache.num_kernel_blocks))
        return parts

    def of_runs(self, runs: Iterable[tuple[int, int]]) -> set[int]:
        """The logical blocks whose rows the byte runs ``[start, end)`` meet."""
        ratio = self._cache.spec.ratio
        blocks: set[int] = set()
        parts = self._parts()
        for lo, hi in runs:
            for start, row, count in parts:
                end = start + row * count
                a, b = max(lo, start), min(hi, end)
                if a >= b:
                    continue
                first, last = (a - start) // row, (b - 1 - start) // row
                blocks.update(range(first // ratio, last // ratio + 1))
        return blocks

    def contains(self, address: int) -> bool:
        """Whether ``address`` lies in one of the cache's buffers (guards included)."""
        return any(raw.data_ptr() <= address < raw.data_ptr() + raw.numel() * raw.element_size()
                   for raw in self._cache.raws)
