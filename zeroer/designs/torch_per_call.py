"""vLLM after #48399, as vLLM writes it: a fresh pinned tensor per call, straight through torch. Race-free.

``async_tensor_h2d``: ``torch.tensor(ids, pin_memory=True).to(device, non_blocking=True)``, then
the zero kernel, all on torch's current stream. The caching host allocator records an event
behind the copy and reuses the pinned block only once that event completed
(pytorch/pytorch#130785). This is the baseline the issue measures our design against (about
38 us a call on an H200, it says); it uses our cached launcher, as :class:`GraphRingZeroer`'s
fallback does, so the comparison is of the staging, not of Triton's dispatch.

:class:`zeroer.designs.per_call.PerCallZeroer` is the same design written against our runtime,
which the simulator and the happens-before checker can run; this one runs on CUDA only.

Example (needs a GPU)::

    z = TorchPerCallZeroer(cache)
    z.zero_block_ids([3, 9])
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from zeroer.designs.common import validate_block_ids
from zeroer.kernel import zero_blocks
from zeroer.protocol import Capabilities, IDS_CONTAINERS
from zeroer.cache.layout import KVCache


class TorchPerCallZeroer:
    name = "torch_per_call"
    # Outside the runtime: the controlled mode cannot gate it. It reads cache.table on every call.
    capabilities = Capabilities(api="runtime", ids_as=IDS_CONTAINERS, backends=("cuda",), cuda_modes=("free",), follows_reallocation=True)

    def __init__(self, cache: KVCache, runtime: object = None) -> None:
        if cache.device.type != "cuda":
            raise ValueError(
                f"torch_per_call runs on CUDA, but the cache lives on {cache.device}; build it with "
                f"build_cache(spec, device='cuda'), or use per_call (the same design) on the simulator"
            )
        self.cache = cache
        self.num_blocks = cache.spec.num_blocks
        self.device = cache.device

    def zero_block_ids(self, block_ids: Iterable[int] | None) -> None:
        ids = validate_block_ids(block_ids, self.num_blocks)
        if not ids:
            return
        staged = torch.tensor(ids, dtype=torch.int64, pin_memory=True)
        zero_blocks(self.cache.table, staged.to(self.device, non_blocking=True))

    def warmup(self) -> None:
        self.zero_block_ids([0])
