"""The reference zeroer: plain torch indexing, no Triton, no staging buffer. Race-free.

It captures a private copy of the ids on the host when called and enqueues one launch that zeroes
those blocks through the cache's typed tensors (not the address table), so it is independent of
both the kernel and the staging designs: the fuzzer's differential baseline, and the fastest
zeroer on the simulator.

Example::

    z = ReferenceZeroer(cache, rt)
    z.zero_block_ids([3, 5])
"""

from __future__ import annotations

import itertools

from zeroer.kernel import zero_blocks_reference
from zeroer.cache.layout import KVCache
from zeroer.protocol import Capabilities, IDS_CONTAINERS
from kvdevice.runtime import Runtime
from zeroer.designs.common import validate_block_ids


class ReferenceZeroer:
    name = "reference"
    capabilities = Capabilities(api="runtime", ids_as=IDS_CONTAINERS, follows_reallocation=True)

    def __init__(self, cache: KVCache, runtime: Runtime) -> None:
        self.cache = cache
        self.rt = runtime
        self._calls = itertools.count(1)

    def zero_block_ids(self, block_ids: list[int]) -> None:
        ids = validate_block_ids(block_ids, self.cache.spec.num_blocks)
        if not ids:
            return
        cache, snapshot = self.cache, tuple(ids)  # ours: the caller may reuse its list (contract 3)
        with self.rt.annotate(f"reference.zero_block_ids#{next(self._calls)}({list(snapshot)})"):
            self.rt.launch(
                lambda: zero_blocks_reference(cache, snapshot), name="zero_reference", blocks_written=snapshot
            )

    def warmup(self) -> None:
        self.zero_block_ids([0])
