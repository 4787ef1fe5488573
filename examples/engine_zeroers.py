"""Four KV-block zeroers written the way engine code writes them: plain torch, Triton, torch.cuda.

Nothing here imports the fuzzer's runtime. Each class is a ``KVBlockZeroer`` in the style of
vLLM's (``vllm/v1/worker/utils.py``): an address table built once from the KV tensors'
``data_ptr()`` and strides, ids staged in host memory, a non-blocking copy to the device, and a
Triton kernel that zeroes every page through the raw addresses. They differ only in how the ids
are staged, which is where vLLM's zeroer had its race:

=========================  ==============================================================  ==========
factory                    staging                                                         verdict
=========================  ==============================================================  ==========
``single_pinned_buffer``   one persistent pinned buffer, written through a numpy view        racy (#48085)
``pinned_ring``            a ring of 2 pinned/device pairs, no events                        racy (3 calls outstanding)
``fresh_pinned_per_call``  a fresh pinned tensor per call, dropped once copied (#48399)      race-free
``event_guarded_ring``     a ring whose slots are reused only after their event completed    race-free
=========================  ==============================================================  ==========

Fuzz one as it is, on the CPU simulator or on a GPU (docs/fuzz-your-zeroer.md)::

    python -m pytest fuzz --zeroer examples/engine_zeroers.py:single_pinned_buffer
    python -m pytest fuzz --zeroer examples/engine_zeroers.py:event_guarded_ring --backend cuda

A factory gets the KV cache to zero (``cache.layer_tensors``: layer name -> KV tensor, and
``cache.spec`` for the block sizes) and a runtime it does not need.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

MAX_CHUNK = 1024  # int32 words one program zeroes


@triton.jit
def _zero_kv_blocks_kernel(
    seg_addrs_ptr,  # uint64[n_segs]: byte address of block 0's page in each segment
    seg_strides_ptr,  # int64[n_segs]: int32 words from one logical block to the next
    seg_pages_ptr,  # int64[n_segs]: int32 words to zero per block
    block_ids_ptr,  # int64[n]: the blocks to zero, read when the kernel runs
    BLOCK_SIZE: tl.constexpr,  # int32 words per program
):
    block_id = tl.load(block_ids_ptr + tl.program_id(0))
    seg = tl.program_id(1)
    page = tl.load(seg_pages_ptr + seg)
    base = tl.load(seg_addrs_ptr + seg).to(tl.pointer_type(tl.int32))
    cols = tl.program_id(2) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    row = base + block_id * tl.load(seg_strides_ptr + seg)
    tl.store(row + cols, tl.zeros([BLOCK_SIZE], dtype=tl.int32), mask=cols < page)


class _KVBlockZeroerBase:
    """The address table and the launch, shared by the four stagings below."""

    def __init__(self, cache) -> None:
        self.device = cache.device
        self.num_blocks = cache.spec.num_blocks
        addrs, strides, pages = _segments(cache)
        self.seg_addrs = torch.tensor(addrs, dtype=torch.uint64, device=self.device)
        self.seg_strides = torch.tensor(strides, dtype=torch.int64, device=self.device)
        self.seg_pages = torch.tensor(pages, dtype=torch.int64, device=self.device)
        self.block_size = min(triton.next_power_of_2(max(pages)), MAX_CHUNK)
        self.chunks = triton.cdiv(max(pages), self.block_size)

    def _check(self, block_ids) -> list[int]:
        ids = [int(b) for b in (block_ids if block_ids is not None else [])]
        for b in ids:
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"block id {b} is out of range for a cache of {self.num_blocks} blocks "
                                 f"(valid: 0..{self.num_blocks - 1})")
        return ids

    def _launch(self, idx: torch.Tensor) -> None:
        grid = (idx.numel(), self.seg_addrs.numel(), self.chunks)
        _zero_kv_blocks_kernel[grid](self.seg_addrs, self.seg_strides, self.seg_pages, idx,
                                     BLOCK_SIZE=self.block_size)

    def warmup(self) -> None:
        self.zero_block_ids([0])  # the null block, as vLLM's warm-up does


def _segments(cache) -> tuple[list[int], list[int], list[int]]:
    """(address, block stride, page) per segment, from the KV tensors as vLLM's constructor reads them.

    A K/V-outer tensor ``(2, kernel_blocks, ...)`` gives two segments, a block-outer one a single
    segment; a tensor shared by several layers is zeroed once (de-duplicated by ``data_ptr``). A
    logical block is ``ratio`` kernel blocks; when a kernel block's row is padded (packed views,
    vLLM #50276), each one gets its own segment so the padding is never zeroed.
    """
    spec = cache.spec
    ratio = spec.block_size // spec.kernel_block_size
    addrs, strides, pages, seen = [], [], [], set()
    for tensor in spec.tensors:
        kv = cache.layer_tensors[tensor.layers[0]]
        if kv.data_ptr() in seen:
            continue
        seen.add(kv.data_ptr())
        block_dim = 1 if tensor.kv_outer else 0
        row = kv.stride(block_dim) * kv.element_size() // 4  # int32 words per kernel block, padding included
        page = math.prod(kv.shape[block_dim + 1:]) * kv.element_size() // 4
        parts = [kv.data_ptr() + i * kv.stride(0) * kv.element_size() for i in range(kv.shape[0])] if block_dim else [kv.data_ptr()]
        for start in parts:
            splits = [0] if page == row else range(ratio)
            for j in splits:
                addrs.append(start + j * row * 4)
                strides.append(ratio * row)
                pages.append(ratio * row if page == row else page)
    return addrs, strides, pages


class SinglePinnedBuffer(_KVBlockZeroerBase):
    """vLLM's zeroer before #48085: one persistent pinned buffer, rewritten on every call. Racy.

    Call k+1 writes its ids into the pinned buffer while call k's non-blocking copy from it may
    still be queued behind earlier work, so call k zeroes call k+1's blocks and its own keep the
    previous tenant's bytes.
    """

    def __init__(self, cache, id_cap: int = 8192) -> None:
        super().__init__(cache)
        self._ids_pinned = torch.empty(id_cap, dtype=torch.int64, pin_memory=True)
        self._ids_gpu = torch.empty(id_cap, dtype=torch.int64, device=self.device)

    def zero_block_ids(self, block_ids) -> None:
        ids = self._check(block_ids)
        if not ids:
            return
        n = len(ids)
        self._ids_pinned[:n].numpy()[:] = ids  # a host write no torch op sees
        idx = self._ids_gpu[:n]
        idx.copy_(self._ids_pinned[:n], non_blocking=True)
        self._launch(idx)


class PinnedRing(_KVBlockZeroerBase):
    """vLLM #48085's fix: a ring of pinned/device pairs sized by the in-flight steps. Racy.

    Slot i is rewritten ``depth`` calls after it was last used, assuming its copy ran by then;
    with more calls outstanding than slots it has not.
    """

    def __init__(self, cache, depth: int = 2, id_cap: int = 8192) -> None:
        super().__init__(cache)
        self._pinned = [torch.empty(id_cap, dtype=torch.int64, pin_memory=True) for _ in range(depth)]
        self._gpu = [torch.empty(id_cap, dtype=torch.int64, device=self.device) for _ in range(depth)]
        self._next = 0

    def zero_block_ids(self, block_ids) -> None:
        ids = self._check(block_ids)
        if not ids:
            return
        n, slot = len(ids), self._next
        self._next = (slot + 1) % len(self._pinned)
        self._pinned[slot][:n].numpy()[:] = ids
        idx = self._gpu[slot][:n]
        idx.copy_(self._pinned[slot][:n], non_blocking=True)
        self._launch(idx)


class FreshPinnedPerCall(_KVBlockZeroerBase):
    """vLLM after #48399 (``async_tensor_h2d``): a fresh pinned tensor per call. Race-free.

    PyTorch's pinned allocator keeps the dropped tensor's memory until the copy that reads it has
    run, and the device ids come from the stream-ordered caching allocator.
    """

    def zero_block_ids(self, block_ids) -> None:
        ids = self._check(block_ids)
        if not ids:
            return
        idx = torch.tensor(ids, dtype=torch.int64, pin_memory=True).to(self.device, non_blocking=True)
        self._launch(idx)


class EventGuardedRing(_KVBlockZeroerBase):
    """A ring whose slots are reused only after the event behind their last kernel completed. Race-free.

    Every call records an event on the current stream behind its kernel; a slot is rewritten only
    once that event has completed, which covers the host rewriting pinned ids a queued copy still
    reads and another stream's copy overwriting device ids a queued kernel still reads. When every
    slot is busy the ring grows.
    """

    def __init__(self, cache, slots: int = 2, id_cap: int = 256) -> None:
        super().__init__(cache)
        self._id_cap = id_cap
        self._slots: list[list] = [self._new_slot() for _ in range(slots)]
        self._next = 0

    def _new_slot(self) -> list:
        return [torch.empty(self._id_cap, dtype=torch.int64, pin_memory=True),
                torch.empty(self._id_cap, dtype=torch.int64, device=self.device), None]

    def _idle_slot(self) -> list:
        for k in range(len(self._slots)):
            slot = self._slots[(self._next + k) % len(self._slots)]
            if slot[2] is None or slot[2].query():
                self._next = (self._next + k + 1) % len(self._slots)
                return slot
        self._slots.append(self._new_slot())
        return self._slots[-1]

    def zero_block_ids(self, block_ids) -> None:
        ids = self._check(block_ids)
        if not ids:
            return
        n = len(ids)
        if n > self._id_cap:  # grow every slot once it is idle: wait for all of them
            for slot in self._slots:
                if slot[2] is not None:
                    slot[2].synchronize()
            self._id_cap = 2 * n
            self._slots = [self._new_slot() for _ in self._slots]
        slot = self._idle_slot()
        slot[0][:n].numpy()[:] = ids
        idx = slot[1][:n]
        idx.copy_(slot[0][:n], non_blocking=True)
        self._launch(idx)
        slot[2] = torch.cuda.Event()
        slot[2].record()


def single_pinned_buffer(cache, runtime) -> SinglePinnedBuffer:
    return SinglePinnedBuffer(cache)


def pinned_ring(cache, runtime) -> PinnedRing:
    return PinnedRing(cache)


def fresh_pinned_per_call(cache, runtime) -> FreshPinnedPerCall:
    return FreshPinnedPerCall(cache)


def event_guarded_ring(cache, runtime) -> EventGuardedRing:
    return EventGuardedRing(cache)
