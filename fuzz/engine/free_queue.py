"""The caller's rule for free ids, one definition for blocks and host slots alike.

A KV cache's free blocks and a host pool's free slots are both a FIFO of ids 1..N-1 (id 0 is the
null block every zeroer warm-up and offloader warm-up may write: vLLM's ``null_block``), as vLLM's
free block queue is: an allocation or a store takes from the head, a freed block or an evicted
slot goes back at the tail, and a load takes the block freed last unless told ``oldest``. The
episode (:mod:`fuzz.engine.episode`, :mod:`fuzz.engine.offload`) hands ids out by it, and the
shrinker's handles (:mod:`fuzz.engine.handles`) replay it, so that a program rewritten after ops
were dropped takes the ids the episode will hand out.
"""

from __future__ import annotations

from collections import deque


class FreeQueue(deque):
    """The free ids 1..``count``-1 of a cache or a pool, in the order they are handed out."""

    def __init__(self, count: int) -> None:
        super().__init__(range(1, count))


__all__ = ["FreeQueue"]
