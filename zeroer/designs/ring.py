"""A ring of pinned/device staging pairs with no events: vLLM #48085's fix. Racy past its depth.

Slot ``i`` is rewritten ``max_concurrency`` calls after it was last used, on the assumption that
its copy has run by then. Nothing enforces that: with more calls outstanding than the depth
(several calls per step, warm-up, P/D patches, a long drafting tail) the ring wraps onto a
pending copy and the #48085 race is back. Measured on an H200: depth 2 with 3 outstanding calls
lost block 1.

Example::

    z = RingZeroer(cache, rt, max_concurrency=2)
    for b in (1, 2, 3):
        z.zero_block_ids([b])  # the third call rewrites slot 0 before its copy ran
"""

from __future__ import annotations

from zeroer.cache.layout import KVCache
from kvdevice.runtime import Runtime
from zeroer.designs.common import StagedZeroer
from zeroer.designs.single_buffer import DEFAULT_ID_CAP


class RingZeroer(StagedZeroer):
    name = "ring"

    def __init__(
        self,
        cache: KVCache,
        runtime: Runtime,
        *,
        max_concurrency: int = 2,
        id_cap: int = DEFAULT_ID_CAP,
        kernel: str = "triton",
    ) -> None:
        super().__init__(cache, runtime, kernel=kernel)
        if not isinstance(max_concurrency, int) or max_concurrency < 1:
            # vLLM's ring rejects 0 the same way (ValueError)
            raise ValueError(
                f"max_concurrency={max_concurrency!r} must be a positive int: the ring needs "
                f"at least one staging slot (vLLM sizes it by max_concurrent_batches, e.g. 2)"
            )
        if not isinstance(id_cap, int) or id_cap < 1:
            raise ValueError(f"id_cap={id_cap!r} must be a positive int (vLLM uses {DEFAULT_ID_CAP})")
        self.max_concurrency = max_concurrency
        self.id_cap = id_cap
        self.index = 0
        self._allocate()

    def _allocate(self) -> None:
        self._host = [self.rt.host_buffer(self.id_cap) for _ in range(self.max_concurrency)]
        self._dev = [
            self.rt.device_buffer(self.id_cap, name=f"ring slot {i} ids") for i in range(self.max_concurrency)
        ]
        self.index = 0

    def _origin(self, ids: list[int]) -> str:
        return super()._origin(ids) + f" [slot {self.index}]"

    def _zero(self, ids: list[int]) -> None:
        n = len(ids)
        if n > self.id_cap:
            for buf in self._host:
                self.rt.free_host(buf)
            self.id_cap = 2 * n
            self._allocate()
        slot = self.index
        # a ring's depth alone does not stop reuse; see vLLM #48085 / #48399
        self.rt.write_host(self._host[slot], ids)
        self.rt.copy_h2d(self._dev[slot], self._host[slot], n)
        self._launch_zero(self._dev[slot], n, ids)
        self.index = (slot + 1) % self.max_concurrency
