"""Zoo family 1: host staging memory rewritten before the copy that reads it has run.

A non-blocking host-to-device copy reads its pinned source when the stream *executes* it, not
when it is enqueued (the mechanism of vLLM #48085). Every entry here writes the ids of a
later call into host memory that an earlier, still queued copy has yet to read, so the earlier
kernel zeroes the later call's blocks and the earlier blocks keep their stale bytes. They differ
in why the memory is reused: one persistent buffer, a ring too shallow for the calls in flight,
and memory from outside the caching host allocator, which hands freed memory out again at once.

The kernel is irrelevant to these bugs: they default to the torch kernel (the same device-side
read of the ids as the Triton kernel, without the simulator's interpreter) and accept
``kernel="triton"``.

Example::

    z = UnprotectedStaging(cache, rt)
    z.zero_block_ids([1]); z.zero_block_ids([2])   # the second call rewrites the first's bytes
"""

from __future__ import annotations

from zeroer.designs import PerCallZeroer, RingZeroer, SingleBufferZeroer
from zeroer.designs.single_buffer import DEFAULT_ID_CAP
from zeroer.cache.layout import KVCache
from kvdevice.runtime import Runtime
from zeroer.zoo.entry import ZooEntry, allocate, start


class SingleBuffer(ZooEntry, SingleBufferZeroer):
    """One persistent pinned staging buffer, rewritten by the host on every call.

    Upstream: vLLM's ``KVBlockZeroer`` from #35219 until the fix in **#48085**. Call *k+1* writes
    its ids into ``_ids_pinned`` while call *k*'s non-blocking copy from it is still queued
    behind earlier work (async scheduling, a spec-decode drafting tail), so call *k*'s kernel
    zeroes call *k+1*'s blocks and call *k*'s new blocks keep the previous tenant's bytes.
    Users saw NaN from stale fp32 Mamba state read as fp8/bf16 KV in hybrid models, spreading
    through ``0 * NaN`` masking to every request sharing the block; only under load, so it looked
    like nondeterminism. Measured on an H200 (docs/results.md): ``[1]`` then ``[2]``
    zeroed only ``{2}``, on every run.
    """

    name = "zoo.single_buffer"
    upstream = "vLLM #48085 (pre-fix design)"
    scenario = (start(), allocate(1), allocate(1))

    def __init__(self, cache: KVCache, runtime: Runtime, *, id_cap: int = DEFAULT_ID_CAP, kernel: str = "torch") -> None:
        super().__init__(cache, runtime, id_cap=id_cap, kernel=kernel)


class RingOverrun(ZooEntry, RingZeroer):
    """A ring of pinned/device staging pairs, deeper than the engine's in-flight steps, no events.

    Upstream: the ring of **#48085**, replaced by **#48399**. A ring sized by
    ``max_concurrent_batches`` (here generously, 3) assumes a slot's copy has run by the time
    the ring wraps; nothing enforces it. Several zero calls per step (warm-up, P/D
    ``zero_block_ids([0])`` patches, several zeroers per pool) or a long drafting tail put more
    calls in flight than slots, and the #48085 race is back: on an H200 a depth-2 ring with 3
    outstanding calls zeroed ``{2, 3}`` and lost block 1. Symptom as for the single buffer:
    blocks handed out unzeroed, NaN in hybrid models.
    """

    name = "zoo.ring_overrun"
    upstream = "vLLM #48085 ring, replaced by #48399"
    scenario = (start(), allocate(1), allocate(1), allocate(1), allocate(1))

    def __init__(
        self, cache: KVCache, runtime: Runtime, *, max_concurrency: int = 3, id_cap: int = DEFAULT_ID_CAP, kernel: str = "torch"
    ) -> None:
        super().__init__(cache, runtime, max_concurrency=max_concurrency, id_cap=id_cap, kernel=kernel)


class UnprotectedStaging(ZooEntry, PerCallZeroer):
    """A fresh staging buffer per call, from pinned memory outside the caching host allocator.

    It looks like vLLM's race-free design after **#48399** (``async_tensor_h2d``: stage, copy,
    drop the reference), but the memory comes from a pinned pool the caching host allocator does
    not manage (a ``cudaHostRegister``-ed numpy array wrapped with ``torch.from_blob``, a UVA
    buffer). PyTorch's allocator keeps a freed pinned block until the event recorded behind its
    copy completes (pytorch/pytorch#130785); this pool hands it out again at once, so the next
    call writes its ids into the bytes the previous copy has not read yet (docs/contract.md,
    promise 3). The same failure as #48085, behind code that reads as the fix. The
    closest upstream report: NVIDIA/TensorRT-LLM#16088, KV block offsets clobbered because "the
    CPU runs an iteration ahead, so either input can be clobbered before the previous
    iteration's still-pending gather kernel drains".
    """

    name = "zoo.unprotected_staging"
    upstream = "#48399 design on memory outside the caching allocator (fact 5; TensorRT-LLM#16088)"
    scenario = (start(), allocate(1), allocate(1))

    staging_protected = False  # freed memory is handed out again at once, copy or no copy

    def __init__(self, cache: KVCache, runtime: Runtime, *, kernel: str = "torch") -> None:
        super().__init__(cache, runtime, kernel=kernel)
