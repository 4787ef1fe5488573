"""One persistent pinned staging buffer: vLLM's zeroer before #48085. Racy.

Each call writes the ids into the same pinned buffer on the host *now*, then queues a
non-blocking copy that reads it when the stream gets there. If the stream is still behind
(async scheduling, spec-decode drafting: vLLM #48085), the next call rewrites the buffer
first, the earlier copy moves the later ids, and the earlier blocks are never zeroed. A shorter
later list corrupts only a prefix: ``[1, 2, 3]`` then ``[4]`` zeroes ``{2, 3, 4}`` and leaks
block 1 (measured on an H200).

Example::

    z = SingleBufferZeroer(cache, rt)
    z.zero_block_ids([1]); z.zero_block_ids([2])
    rt.synchronize()          # on the lazy simulator: block 1 still holds stale bytes
"""

from __future__ import annotations

from zeroer.cache.layout import KVCache
from kvdevice.runtime import Runtime
from zeroer.designs.common import StagedZeroer

DEFAULT_ID_CAP = 8192  # vLLM's _id_cap


class SingleBufferZeroer(StagedZeroer):
    name = "single_buffer"

    def __init__(self, cache: KVCache, runtime: Runtime, *, id_cap: int = DEFAULT_ID_CAP, kernel: str = "triton") -> None:
        super().__init__(cache, runtime, kernel=kernel)
        if not isinstance(id_cap, int) or id_cap < 1:
            raise ValueError(f"id_cap={id_cap!r} must be a positive int (vLLM uses {DEFAULT_ID_CAP})")
        self.id_cap = id_cap
        self._host = runtime.host_buffer(id_cap)
        self._dev = runtime.device_buffer(id_cap, name="single_buffer ids")

    def _zero(self, ids: list[int]) -> None:
        n = len(ids)
        if n > self.id_cap:
            # Growth is benign: the caching host allocator keeps the old block until its
            # copy's event completes (pytorch/pytorch#130785).
            self.rt.free_host(self._host)
            self.id_cap = 2 * n
            self._host = self.rt.host_buffer(self.id_cap)
            self._dev = self.rt.device_buffer(self.id_cap, name="single_buffer ids")
        self.rt.write_host(self._host, ids)  # the host rewrites it now: the #48085 race
        self.rt.copy_h2d(self._dev, self._host, n)
        self._launch_zero(self._dev, n, ids)
