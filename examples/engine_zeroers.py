"""KV-block zeroers written the way engine code writes them: plain torch, Triton, torch.cuda.

Nothing here imports the fuzzer's runtime. Each class is a ``KVBlockZeroer`` in the style of
vLLM's (``vllm/v1/worker/utils.py``): ``zero_block_ids(self, block_ids: list[int])`` that returns
at once on an empty list; an address table read on the host once, in the constructor, from the
KV tensors' ``data_ptr()`` and strides (the side-stream ones read the cache's own table back with
``.tolist()``) and kept on the device (``torch.tensor(seg_addrs, dtype=torch.uint64,
device=...)``); the ids staged in pinned host memory and copied to the device without blocking;
a Triton kernel on a 3-D grid ``(blocks, segments, chunks)`` that zeroes every page through the
raw addresses; and a ``warmup(num_kv_blocks)`` that zeroes the null block once. The factory binds
the block count to ``warmup`` (``functools.partial``), as vLLM's runner passes
``kv_cache_config.num_blocks``. They differ in how the ids reach the kernel, which is where
vLLM's zeroer had its race. Each idiom comes racy and race-free:

====================================  =====================================================================  =========
factory                               how the ids reach the kernel                                           verdict
====================================  =====================================================================  =========
``single_pinned_buffer``              one persistent pinned buffer written through a numpy view              racy
                                      (vLLM before #48085)
``fresh_pinned_per_call``             a fresh pinned tensor per call, ``.to(device, non_blocking=True)``     race-free
                                      (#48399's ``async_tensor_h2d``)
``pinned_ring``                       a ring of ``max_concurrency`` pinned/device pairs, no events;          racy
                                      grown after ``torch.accelerator.synchronize()`` (#48085)
``event_guarded_ring``                the same ring, a slot reused only once its event completed             race-free
``side_stream_copy_no_record``        copied on the zeroer's own stream into memory allocated there,         racy
                                      read by the kernel on the caller's, dropped without ``record_stream``
``side_stream_copy_event_on_caller``  the same with ``record_stream``, but the event the caller waits        racy
                                      for recorded on the caller's own stream
``side_stream_copy``                  the same done right: the event recorded on the copy stream,            race-free
                                      the ids tied to the caller's stream by ``record_stream``
====================================  =====================================================================  =========

``VERDICTS`` says the same to the tools (``python -m fuzz.bench.examples`` judges every factory
against it), and each racy factory marks the two lines of its race for the sanitizer's benchmark
(``# race[FACTORY]: queued`` on the op the race is with, ``# race[FACTORY]: later`` on the access
that may overtake it; sanitizer/bench/verdict.py). Fuzz one as it is, on the CPU simulator or on a GPU (docs/fuzz-your-zeroer.md)::

    python -m pytest fuzz --zeroer examples/engine_zeroers.py:single_pinned_buffer
    python -m pytest fuzz --zeroer examples/engine_zeroers.py:event_guarded_ring --backend cuda

A factory gets the KV cache to zero (``cache.layer_tensors``: layer name -> KV tensor,
``cache.spec`` for the block sizes and layouts) and a runtime it does not need.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

VERDICTS = {
    "single_pinned_buffer": "racy",
    "fresh_pinned_per_call": "race-free",
    "pinned_ring": "racy",
    "event_guarded_ring": "race-free",
    "side_stream_copy_no_record": "racy",
    "side_stream_copy_event_on_caller": "racy",
    "side_stream_copy": "race-free",
}

MAX_CHUNK = 1024  # int32 words one program zeroes at most


@triton.jit
def _zero_kv_blocks_kernel(
    seg_addrs_ptr,  # uint64[n_segs]: byte address of logical block 0's page in each segment
    seg_block_strides_ptr,  # int64[n_segs]: int32 words from one logical block to the next
    seg_page_sizes_ptr,  # int64[n_segs]: int32 words to zero per block (pages differ: MLA, packed rows)
    block_ids_ptr,  # int64[n_blocks]: the blocks to zero, read when the kernel runs
    BLOCK_SIZE: tl.constexpr,  # int32 words per program
):
    block_id = tl.load(block_ids_ptr + tl.program_id(0))
    seg = tl.program_id(1)
    seg_addr = tl.load(seg_addrs_ptr + seg)
    block_stride = tl.load(seg_block_strides_ptr + seg)
    page_size = tl.load(seg_page_sizes_ptr + seg)
    cols = tl.program_id(2).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE).to(tl.int64)
    page = tl.cast(seg_addr, tl.pointer_type(tl.int32)) + block_id * block_stride
    tl.store(page + cols, tl.zeros([BLOCK_SIZE], dtype=tl.int32), mask=cols < page_size)


def _segments(cache) -> tuple[list[int], list[int], list[int]]:
    """(byte address, block stride, page size) per segment, read from the KV tensors as vLLM's
    constructor reads them: ``data_ptr()``, ``stride()``, ``element_size()``.

    A K/V-outer tensor ``(2, kernel_blocks, ...)`` gives a segment per part, a block-outer one
    ``(kernel_blocks, ...)`` one; a tensor bound to several layers is zeroed once (de-duplicated
    by ``data_ptr``). A logical block is ``ratio`` kernel blocks (virtual block splitting): one
    segment spans them when they are contiguous, and each gets its own segment when a packed row
    leaves padding after its page (vLLM #50276), so the padding is never zeroed.
    """
    ratio = cache.spec.block_size // cache.spec.kernel_block_size
    seg_addrs, seg_block_strides, seg_page_sizes = [], [], []
    seen = set()
    for tensor in cache.spec.tensors:
        for layer_name in tensor.layers:
            kv = cache.layer_tensors[layer_name]
            if kv.data_ptr() in seen:
                continue
            seen.add(kv.data_ptr())
            block_dim = 1 if tensor.kv_outer else 0  # vLLM asks the attention backend
            row = kv.stride(block_dim) * kv.element_size() // 4  # words per kernel block, padding included
            page = math.prod(kv.shape[block_dim + 1:]) * kv.element_size() // 4
            parts = range(kv.shape[0]) if block_dim else range(1)
            for part in parts:
                addr = kv.data_ptr() + part * kv.stride(0) * kv.element_size()
                if page == row:
                    seg_addrs.append(addr)
                    seg_block_strides.append(ratio * row)
                    seg_page_sizes.append(ratio * row)
                    continue
                for split in range(ratio):
                    seg_addrs.append(addr + split * row * 4)
                    seg_block_strides.append(ratio * row)
                    seg_page_sizes.append(page)
    return seg_addrs, seg_block_strides, seg_page_sizes


class _KVBlockZeroerBase:
    """What every zeroer below has of vLLM's: the address table, the launch and the warm-up."""

    def __init__(self, cache) -> None:
        self.device = cache.device
        seg_addrs, seg_block_strides, seg_page_sizes = self._address_table(cache)
        max_page = max(seg_page_sizes)
        blk_size = min(1 << (max_page - 1).bit_length(), MAX_CHUNK)
        self._meta = (
            torch.tensor(seg_addrs, dtype=torch.uint64, device=self.device),
            torch.tensor(seg_block_strides, dtype=torch.int64, device=self.device),
            torch.tensor(seg_page_sizes, dtype=torch.int64, device=self.device),
            triton.cdiv(max_page, blk_size),
            blk_size,
            len(seg_addrs),
        )

    def _address_table(self, cache) -> tuple[list[int], list[int], list[int]]:
        """(address, block stride, page size) per segment, as host ints."""
        return _segments(cache)

    def _launch(self, idx: torch.Tensor) -> None:
        """Zero the blocks ``idx`` (int64, on the device) names, on the current stream."""
        seg_addrs, seg_block_strides, seg_page_sizes, max_chunks, blk_size, n_segs = self._meta
        grid = (idx.shape[0], n_segs, max_chunks)
        _zero_kv_blocks_kernel[grid](seg_addrs, seg_block_strides, seg_page_sizes, idx, BLOCK_SIZE=blk_size)  # race[side_stream_copy_no_record]: queued; race[side_stream_copy_event_on_caller]: later

    def warmup(self, num_kv_blocks: int) -> None:
        if num_kv_blocks > 0:
            self.zero_block_ids([0])  # the null block: compiles and loads the kernel, as vLLM's does


# -- 1. one pinned buffer, or a fresh one per call ---------------------------------------------------


class SinglePinnedBuffer(_KVBlockZeroerBase):
    """vLLM's zeroer before #48085: one persistent pinned buffer, rewritten on every call. Racy.

    Call k+1 writes its ids into the pinned buffer while call k's non-blocking copy from it may
    still be queued behind earlier work, so call k zeroes call k+1's blocks and its own keep the
    previous tenant's bytes.
    """

    def __init__(self, cache) -> None:
        super().__init__(cache)
        self._id_cap = 8192
        self._ids_pinned = torch.empty(self._id_cap, dtype=torch.int64, pin_memory=True)
        self._ids_gpu = torch.empty(self._id_cap, dtype=torch.int64, device=self.device)

    def zero_block_ids(self, block_ids: list[int]) -> None:
        if not block_ids:
            return
        n = len(block_ids)
        if n > self._id_cap:
            self._id_cap = 2 * n
            self._ids_pinned = torch.empty(self._id_cap, dtype=torch.int64, pin_memory=True)
            self._ids_gpu = torch.empty(self._id_cap, dtype=torch.int64, device=self.device)
        self._ids_pinned[:n].numpy()[:] = block_ids  # a host write no torch op sees: the race; race[single_pinned_buffer]: later
        idx = self._ids_gpu[:n]
        idx.copy_(self._ids_pinned[:n], non_blocking=True)  # race[single_pinned_buffer]: queued
        self._launch(idx)


class FreshPinnedPerCall(_KVBlockZeroerBase):
    """vLLM after #48399 (``async_tensor_h2d``): a fresh pinned tensor per call. Race-free.

    PyTorch's pinned allocator keeps the dropped tensor's memory until the copy that reads it has
    run, and the device ids come from the stream-ordered caching allocator.
    """

    def zero_block_ids(self, block_ids: list[int]) -> None:
        if not block_ids:
            return
        idx = torch.tensor(block_ids, dtype=torch.int64, pin_memory=True).to(self.device, non_blocking=True)
        self._launch(idx)


# -- 2. a ring of pinned/device pairs --------------------------------------------------------------


class PinnedRing(_KVBlockZeroerBase):
    """vLLM #48085: a ring of ``max_concurrency`` pinned/device pairs, used round-robin. Racy.

    Slot i is rewritten ``max_concurrency`` calls after it was last used, on the assumption that
    its copy ran by then; with more calls outstanding than slots it has not (a ring's depth alone
    does not stop reuse; vLLM #48399 replaced it). A call with more ids than the buffers hold
    synchronises the device and reallocates them, as #48085 does; ``id_cap`` starts small here
    (vLLM's starts at 8192) so the fuzzer's calls reach that path.
    """

    def __init__(self, cache, max_concurrency: int = 2, id_cap: int = 4) -> None:
        super().__init__(cache)
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency={max_concurrency}: the ring needs at least 1 slot")
        self.max_concurrency = max_concurrency
        self._id_cap = id_cap
        self._allocate_id_buffers()

    def _allocate_id_buffers(self) -> None:
        self._ids_pinned = [torch.empty(self._id_cap, dtype=torch.int64, pin_memory=True)
                            for _ in range(self.max_concurrency)]
        self._ids_gpu = [torch.empty(self._id_cap, dtype=torch.int64, device=self.device)
                         for _ in range(self.max_concurrency)]
        self._id_buffer_index = 0

    def zero_block_ids(self, block_ids: list[int]) -> None:
        if not block_ids:
            return
        n = len(block_ids)
        if n > self._id_cap:
            torch.accelerator.synchronize()  # nothing still reads the old buffers
            self._id_cap = 2 * n
            self._allocate_id_buffers()
        i = self._id_buffer_index
        self._id_buffer_index = (i + 1) % self.max_concurrency
        pinned = self._ids_pinned[i]
        pinned[:n].numpy()[:] = block_ids  # may still be read by the copy of call k - max_concurrency; race[pinned_ring]: later
        idx = self._ids_gpu[i][:n]
        idx.copy_(pinned[:n], non_blocking=True)  # race[pinned_ring]: queued
        self._launch(idx)


class EventGuardedRing(PinnedRing):
    """The same ring, with an event per slot recorded behind its kernel. Race-free.

    Before a slot is rewritten the host waits for its event: the kernel that last read the
    slot's device ids has run, and so has the copy that read its pinned ids, whichever stream
    either was queued on. A call with more ids than the buffers hold waits for every slot's event
    before the buffers are dropped.
    """

    def __init__(self, cache, max_concurrency: int = 2, id_cap: int = 4) -> None:
        super().__init__(cache, max_concurrency, id_cap)
        self._events = [torch.cuda.Event() for _ in range(max_concurrency)]

    def zero_block_ids(self, block_ids: list[int]) -> None:
        if not block_ids:
            return
        n = len(block_ids)
        if n > self._id_cap:
            for event in self._events:
                event.synchronize()
            self._id_cap = 2 * n
            self._allocate_id_buffers()
        i = self._id_buffer_index
        self._id_buffer_index = (i + 1) % self.max_concurrency
        self._events[i].synchronize()  # the slot's last kernel has run (at once if never recorded)
        pinned = self._ids_pinned[i]
        pinned[:n].numpy()[:] = block_ids
        idx = self._ids_gpu[i][:n]
        idx.copy_(pinned[:n], non_blocking=True)
        self._launch(idx)
        self._events[i].record()  # on the current stream, behind the kernel


# -- 3. the ids copied on a stream of the zeroer's own ---------------------------------------------


class SideStreamCopy(_KVBlockZeroerBase):
    """The ids copied on the zeroer's own stream, the kernel on the caller's. Race-free.

    The copy runs on a stream made in the constructor, into device memory the caching allocator
    hands out on that stream. The caller's stream waits for an event recorded behind the copy
    before the kernel reads the ids, and ``record_stream(caller)`` keeps the dropped ids' block
    from going back to the copy stream's pool until the caller's stream has run the kernel.
    """

    def __init__(self, cache) -> None:
        super().__init__(cache)
        self._copy_stream = torch.cuda.Stream()
        self._ids_copied = torch.cuda.Event()

    def _address_table(self, cache) -> tuple[list[int], list[int], list[int]]:
        # The cache's own table (cache.table: device tensors) instead of one built from the KV
        # tensors, read back to the host once; .tolist() waits for the stream that filled it.
        table = cache.table
        return table.addrs.tolist(), table.block_strides.tolist(), table.pages.tolist()

    def zero_block_ids(self, block_ids: list[int]) -> None:
        if not block_ids:
            return
        caller = torch.cuda.current_stream()
        ids_cpu = torch.tensor(block_ids, dtype=torch.int64, pin_memory=True)
        with torch.cuda.stream(self._copy_stream):
            idx = ids_cpu.to(self.device, non_blocking=True)  # allocated on the copy stream
            self._ids_copied.record()  # on the copy stream, behind the copy
        caller.wait_event(self._ids_copied)
        self._launch(idx)
        idx.record_stream(caller)  # freed, the block waits for the caller's stream too


class SideStreamCopyNoRecord(SideStreamCopy):
    """The same without ``record_stream``. Racy.

    Dropped, the ids' block goes back to the copy stream's pool at once: the next call's copy on
    that stream may be handed it and rewrite it before the caller's stream has run the kernel
    that reads it.
    """

    def zero_block_ids(self, block_ids: list[int]) -> None:
        if not block_ids:
            return
        caller = torch.cuda.current_stream()
        ids_cpu = torch.tensor(block_ids, dtype=torch.int64, pin_memory=True)
        with torch.cuda.stream(self._copy_stream):
            idx = ids_cpu.to(self.device, non_blocking=True)  # race[side_stream_copy_no_record]: later
            self._ids_copied.record()
        caller.wait_event(self._ids_copied)
        self._launch(idx)  # and idx is dropped with no record_stream(caller)


class SideStreamCopyEventOnCaller(SideStreamCopy):
    """The same with the event recorded on the wrong stream. Racy.

    ``record()`` outside the ``with`` block records on the caller's stream, so the caller waits
    for itself: nothing orders the kernel after the copy that writes the ids it reads.
    """

    def zero_block_ids(self, block_ids: list[int]) -> None:
        if not block_ids:
            return
        caller = torch.cuda.current_stream()
        ids_cpu = torch.tensor(block_ids, dtype=torch.int64, pin_memory=True)
        with torch.cuda.stream(self._copy_stream):
            idx = ids_cpu.to(self.device, non_blocking=True)  # race[side_stream_copy_event_on_caller]: queued
        self._ids_copied.record()  # on the caller's stream: orders nothing after the copy
        caller.wait_event(self._ids_copied)
        self._launch(idx)
        idx.record_stream(caller)


# -- factories: build the zeroer for the cache, bind the warm-up's block count --------------------


def _factory(zeroer_class):
    """The factory ``(cache, runtime)`` of ``zeroer_class``: the zeroer with ``warmup`` bound to the
    cache's block count, as vLLM's runner passes ``kv_cache_config.num_blocks``: the harness then
    calls ``warmup()``."""

    def factory(cache, runtime):
        zeroer = zeroer_class(cache)
        zeroer.warmup = functools.partial(zeroer.warmup, cache.spec.num_blocks)
        return zeroer

    return factory


single_pinned_buffer = _factory(SinglePinnedBuffer)
fresh_pinned_per_call = _factory(FreshPinnedPerCall)
pinned_ring = _factory(PinnedRing)
event_guarded_ring = _factory(EventGuardedRing)
side_stream_copy_no_record = _factory(SideStreamCopyNoRecord)
side_stream_copy_event_on_caller = _factory(SideStreamCopyEventOnCaller)
side_stream_copy = _factory(SideStreamCopy)
