"""A fresh pinned staging tensor per call: vLLM after #48399 (``async_tensor_h2d``). Race-free.

Every call stages its ids in a new block from the caching host allocator and drops it right
after queueing the copy. The allocator records an event behind the copy and hands the block out
again only once that event completed (pytorch/pytorch#130785), so no host write can reach a
pending copy however far the host runs ahead. The device buffer comes from the stream-ordered
device allocator, so the kernel's read of it is ordered too. The price is an allocator call
and an event per call (issue: measure it).

Example::

    z = PerCallZeroer(cache, rt)
    for b in (1, 2, 3):
        z.zero_block_ids([b])   # three distinct pinned blocks
"""

from __future__ import annotations

from kvdevice.runtime import DeviceBuffer
from zeroer.designs.common import StagedZeroer


class PerCallZeroer(StagedZeroer):
    name = "per_call"
    #: staging memory from the caching host allocator; the zoo's unprotected variant sets False
    staging_protected = True

    def _device_ids(self, n: int) -> DeviceBuffer:
        """Where the ids land on the device: a fresh stream-ordered buffer per call."""
        return self.rt.device_buffer(n, name=f"{self.name} ids")

    def _zero(self, ids: list[int]) -> None:
        n = len(ids)
        host = self.rt.host_buffer(n, protected=self.staging_protected)
        self.rt.write_host(host, ids)
        dev = self._device_ids(n)
        self.rt.copy_h2d(dev, host, n)
        self._launch_zero(dev, n, ids)
        self.rt.free_host(host)  # async_tensor_h2d keeps no reference either
