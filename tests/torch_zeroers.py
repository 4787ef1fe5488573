"""Plain torch zeroers that the intercepted fuzzer must judge rightly (tests/test_intercept.py).

Each is a variation of ``examples/engine_zeroers.py``, written the same way (vLLM's
``KVBlockZeroer`` idioms: ``zero_block_ids(self, block_ids: list[int])``, ``if not block_ids:
return``, streams and events made in the constructor, ``warmup(num_kv_blocks)`` bound by the
factory) and different in one way an engine's code could be: racy ones name their race,
race-free ones say why they are. None imports the runtime.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from engine_zeroers import FreshPinnedPerCall, _KVBlockZeroerBase  # examples/ is on sys.path (conftest)


class SideStreamNoWait(_KVBlockZeroerBase):
    """Zeroes on a side stream and never joins it back to the caller's. Racy (contract 1)."""

    def __init__(self, cache) -> None:
        super().__init__(cache)
        self._zero_stream = torch.cuda.Stream()

    def zero_block_ids(self, block_ids: list[int]) -> None:
        if not block_ids:
            return
        self._zero_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._zero_stream):
            idx = torch.tensor(block_ids, dtype=torch.int64, pin_memory=True).to(self.device, non_blocking=True)
            self._launch(idx)


class SideStreamJoined(SideStreamNoWait):
    """The same, with the caller's stream waiting for the side stream after the launch. Race-free."""

    def zero_block_ids(self, block_ids: list[int]) -> None:
        super().zero_block_ids(block_ids)
        torch.cuda.current_stream().wait_stream(self._zero_stream)


class DeviceIdsToSideStream(_KVBlockZeroerBase):
    """Stages each call's ids on a side stream, in device memory allocated there, for a kernel on
    the caller's stream, then drops them. The block goes back to the side stream's pool, and the
    next call's copy on the side stream may rewrite it before the caller's stream has run the
    kernel that reads it: ``record_stream`` is what ties the block to the caller's stream. Racy.

    (``examples/engine_zeroers.py:side_stream_copy_no_record`` is the same race with ``.to()``
    and an event; here the copy is ``torch.empty`` plus ``copy_`` and the join ``wait_stream``.)
    """

    def __init__(self, cache) -> None:
        super().__init__(cache)
        self._copy_stream = torch.cuda.Stream()

    def zero_block_ids(self, block_ids: list[int]) -> None:
        if not block_ids:
            return
        caller = torch.cuda.current_stream()
        ids_cpu = torch.tensor(block_ids, dtype=torch.int64, pin_memory=True)
        with torch.cuda.stream(self._copy_stream):
            idx = torch.empty(len(block_ids), dtype=torch.int64, device=self.device)
            idx.copy_(ids_cpu, non_blocking=True)
        caller.wait_stream(self._copy_stream)
        self._launch(idx)


class DeviceIdsToSideStreamRecorded(DeviceIdsToSideStream):
    """The same with ``idx.record_stream(caller)``: the block waits for the caller's stream. Race-free."""

    def zero_block_ids(self, block_ids: list[int]) -> None:
        if not block_ids:
            return
        caller = torch.cuda.current_stream()
        ids_cpu = torch.tensor(block_ids, dtype=torch.int64, pin_memory=True)
        with torch.cuda.stream(self._copy_stream):
            idx = torch.empty(len(block_ids), dtype=torch.int64, device=self.device)
            idx.copy_(ids_cpu, non_blocking=True)
        caller.wait_stream(self._copy_stream)
        self._launch(idx)
        idx.record_stream(caller)


class PageableStaging(_KVBlockZeroerBase):
    """Ids in a fresh pageable tensor, copied non-blocking: CUDA stages them before returning. Race-free."""

    def zero_block_ids(self, block_ids: list[int]) -> None:
        if not block_ids:
            return
        idx = torch.tensor(block_ids, dtype=torch.int64).to(self.device, non_blocking=True)
        self._launch(idx)


class PersistentPageableBuffer(_KVBlockZeroerBase):
    """One persistent pageable host buffer and one persistent device buffer. The host side is safe
    (a non-blocking copy from pageable memory is staged before it returns), the device side is not:
    the next call, on whichever stream is then current, rewrites the device ids while the kernel
    queued on the previous call's stream may not have read them (contract 2). Racy."""

    def __init__(self, cache) -> None:
        super().__init__(cache)
        self._ids_cpu = torch.empty(8192, dtype=torch.int64)
        self._ids_gpu = torch.empty(8192, dtype=torch.int64, device=self.device)

    def zero_block_ids(self, block_ids: list[int]) -> None:
        if not block_ids:
            return
        n = len(block_ids)
        self._ids_cpu[:n] = torch.tensor(block_ids, dtype=torch.int64)
        idx = self._ids_gpu[:n]
        idx.copy_(self._ids_cpu[:n], non_blocking=True)
        self._launch(idx)


class PageableStagingPerCallDevice(_KVBlockZeroerBase):
    """A persistent pageable host buffer, fresh device ids per call. Race-free."""

    def __init__(self, cache) -> None:
        super().__init__(cache)
        self._ids_cpu = torch.empty(8192, dtype=torch.int64)

    def zero_block_ids(self, block_ids: list[int]) -> None:
        if not block_ids:
            return
        n = len(block_ids)
        self._ids_cpu[:n] = torch.tensor(block_ids, dtype=torch.int64)
        self._launch(self._ids_cpu[:n].to(self.device, non_blocking=True))


class PinnedBufferSynchronized(_KVBlockZeroerBase):
    """One persistent pinned buffer, with ``event.synchronize()`` before each rewrite. Race-free."""

    def __init__(self, cache) -> None:
        super().__init__(cache)
        self._ids_pinned = torch.empty(8192, dtype=torch.int64, pin_memory=True)
        self._ids_gpu = torch.empty(8192, dtype=torch.int64, device=self.device)
        self._ids_read = torch.cuda.Event()

    def zero_block_ids(self, block_ids: list[int]) -> None:
        if not block_ids:
            return
        self._ids_read.synchronize()  # the last call's kernel has run (at once if never recorded)
        n = len(block_ids)
        self._ids_pinned[:n] = torch.tensor(block_ids, dtype=torch.int64)  # a torch op this time: seen directly
        idx = self._ids_gpu[:n]
        idx.copy_(self._ids_pinned[:n], non_blocking=True)
        self._launch(idx)
        self._ids_read.record()


class PinnedBufferCtypes(_KVBlockZeroerBase):
    """One persistent pinned buffer written with ``ctypes.memmove``, no synchronisation. Racy."""

    def __init__(self, cache) -> None:
        super().__init__(cache)
        self._ids_pinned = torch.empty(8192, dtype=torch.int64, pin_memory=True)
        self._ids_gpu = torch.empty(8192, dtype=torch.int64, device=self.device)

    def zero_block_ids(self, block_ids: list[int]) -> None:
        if not block_ids:
            return
        n = len(block_ids)
        staged = (ctypes.c_int64 * n)(*block_ids)
        ctypes.memmove(self._ids_pinned.data_ptr(), staged, 8 * n)
        idx = self._ids_gpu[:n]
        idx.copy_(self._ids_pinned[:n], non_blocking=True)
        self._launch(idx)


class TorchIndexFill:
    """No Triton: zeroes every layer's pages with ``index_fill_`` on device ids. Race-free."""

    def __init__(self, cache) -> None:
        self.device = cache.device
        self.ratio = cache.spec.block_size // cache.spec.kernel_block_size
        self.kv_caches = []  # (tensor, block dim), each tensor once
        for tensor in cache.spec.tensors:
            kv = cache.layer_tensors[tensor.layers[0]]
            self.kv_caches.append((kv, 1 if tensor.kv_outer else 0))

    def zero_block_ids(self, block_ids: list[int]) -> None:
        if not block_ids:
            return
        rows = [b * self.ratio + j for b in block_ids for j in range(self.ratio)]  # kernel blocks
        idx = torch.tensor(rows, dtype=torch.int64, pin_memory=True).to(self.device, non_blocking=True)
        for kv, block_dim in self.kv_caches:
            kv.index_fill_(block_dim, idx, 0)

    def warmup(self, num_kv_blocks: int) -> None:
        if num_kv_blocks > 0:
            self.zero_block_ids([0])


class WildKernel(FreshPinnedPerCall):
    """Aims the kernel at a table whose first address is off by a megabyte. Racy (illegal address)."""

    def __init__(self, cache) -> None:
        super().__init__(cache)
        seg_addrs = self._meta[0].tolist()  # read back from the device, as vLLM's tests read it
        seg_addrs[0] += 1 << 20
        self._meta = (torch.tensor(seg_addrs, dtype=torch.uint64, device=self.device), *self._meta[1:])


def factory(cls):
    """``name(cache, runtime)``: build ``cls`` for the cache and bind the warm-up's block count."""

    def make(cache, runtime):
        zeroer = cls(cache)
        zeroer.warmup = functools.partial(zeroer.warmup, cache.spec.num_blocks)
        return zeroer

    make.__name__ = cls.__name__
    return make


side_stream_no_wait = factory(SideStreamNoWait)
side_stream_joined = factory(SideStreamJoined)
device_ids_to_side_stream = factory(DeviceIdsToSideStream)
device_ids_to_side_stream_recorded = factory(DeviceIdsToSideStreamRecorded)
pageable_staging = factory(PageableStaging)
persistent_pageable_buffer = factory(PersistentPageableBuffer)
pageable_staging_per_call_device = factory(PageableStagingPerCallDevice)
pinned_buffer_synchronized = factory(PinnedBufferSynchronized)
pinned_buffer_ctypes = factory(PinnedBufferCtypes)
torch_index_fill = factory(TorchIndexFill)
wild_kernel = factory(WildKernel)

RACY = ("side_stream_no_wait", "device_ids_to_side_stream", "pinned_buffer_ctypes", "wild_kernel",
        "persistent_pageable_buffer")
RACE_FREE = ("side_stream_joined", "device_ids_to_side_stream_recorded", "pageable_staging",
             "pageable_staging_per_call_device", "pinned_buffer_synchronized", "torch_index_fill")
