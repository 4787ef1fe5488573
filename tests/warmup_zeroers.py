"""A zeroer whose warm-up breaks its own staging rule: race-free behind vLLM's start-up (which
synchronises after the warm-up), racy behind the stricter caller (``pytest fuzz --strict-caller``).

It stages ids in one pinned buffer, reused only once the event recorded after its last copy has
completed; the warm-up copies from the same buffer but records no event, so a first call that comes
before the device has run the warm-up rewrites the buffer under the warm-up's queued copy.
"""

from __future__ import annotations

import torch

from zeroer.protocol import Capabilities


class WarmupWithoutEvent:
    capabilities = Capabilities(geometries=("tiny",))

    def __init__(self, cache, runtime=None) -> None:
        self.layers = list({t.data_ptr(): t for t in cache.layer_tensors.values()}.values())
        self.staging = torch.empty(16, dtype=torch.int64, pin_memory=True)
        self.ids = torch.empty(16, dtype=torch.int64, device=cache.device)
        self.event = None

    def _zero(self, block_ids: list[int]) -> None:
        if self.event is not None:
            self.event.synchronize()  # the last copy from the buffer has run
        n = len(block_ids)
        self.staging.numpy()[:n] = block_ids
        self.ids[:n].copy_(self.staging[:n], non_blocking=True)
        for kv in self.layers:
            kv.index_fill_(1, self.ids[:n], 0)  # tiny: K/V outermost, one kernel block per block

    def warmup(self) -> None:
        self._zero([0])  # BUG: no event recorded after the warm-up's copy

    def zero_block_ids(self, block_ids: list[int]) -> None:
        if not block_ids:
            return
        self._zero(block_ids)
        self.event = torch.cuda.Event()
        self.event.record()
