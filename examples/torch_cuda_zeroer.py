"""A zeroer written directly against torch.cuda, as vLLM's own class is, plugged in by a factory.

It stages ids the way vLLM did before #48085: one persistent pinned buffer, a non-blocking copy
and the Triton kernel on torch's current stream. It knows nothing of our runtime, so it runs on
the cuda backend only, the value oracle judges it, and the happens-before checker sees only the
harness's own work around it (docs/zeroer-api.md).

    python -m pytest fuzz --backend cuda --cuda-mode free --zeroer examples/torch_cuda_zeroer.py:make_single_buffer

`make_per_call` is the #48399 fix, for comparison: ``zeroer.designs.TorchPerCallZeroer``, which
the fuzzer also runs by its registered name ``torch_per_call``.
"""

from __future__ import annotations

import torch

from zeroer.designs import TorchPerCallZeroer
from zeroer.designs import validate_block_ids
from zeroer.kernel import zero_blocks
from zeroer.cache.layout import KVCache


class TorchSingleBufferZeroer:
    def __init__(self, cache: KVCache, id_cap: int = 8192) -> None:
        self.table = cache.table
        self.num_blocks = cache.spec.num_blocks
        self.pinned = torch.empty(id_cap, dtype=torch.int64, pin_memory=True)
        self.device_ids = torch.empty(id_cap, dtype=torch.int64, device=cache.device)

    def zero_block_ids(self, block_ids: list[int]) -> None:
        ids = validate_block_ids(block_ids, self.num_blocks)
        if not ids:
            return
        n = len(ids)
        self.pinned[:n] = torch.tensor(ids, dtype=torch.int64)  # rewritten now: the #48085 race
        self.device_ids[:n].copy_(self.pinned[:n], non_blocking=True)
        zero_blocks(self.table, self.device_ids[:n])


def make_single_buffer(cache: KVCache, runtime: object) -> TorchSingleBufferZeroer:
    """Factory: ``factory(cache, runtime)``; the runtime is unused by a torch.cuda zeroer."""
    return TorchSingleBufferZeroer(cache)


def make_per_call(cache: KVCache, runtime: object) -> TorchPerCallZeroer:
    return TorchPerCallZeroer(cache)
