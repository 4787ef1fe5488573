"""Plain torch zeroers that the intercepted fuzzer must judge rightly (tests/test_intercept.py).

Each is a variation of ``examples/engine_zeroers.py`` that differs in one way an engine's code
could: racy ones name their race, race-free ones say why they are. None imports the runtime.
"""

from __future__ import annotations

import ctypes

import torch

from engine_zeroers import FreshPinnedPerCall, _KVBlockZeroerBase, _segments  # examples/ is on sys.path (conftest)


class SideStreamNoWait(FreshPinnedPerCall):
    """Zeroes on a side stream and never joins it back to the caller's. Racy (contract 1)."""

    def __init__(self, cache) -> None:
        super().__init__(cache)
        self.side = torch.cuda.Stream()

    def zero_block_ids(self, block_ids) -> None:
        ids = self._check(block_ids)
        if not ids:
            return
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            idx = torch.tensor(ids, dtype=torch.int64, pin_memory=True).to(self.device, non_blocking=True)
            self._launch(idx)


class SideStreamJoined(SideStreamNoWait):
    """The same, with the caller's stream waiting for the side stream after the launch. Race-free."""

    def zero_block_ids(self, block_ids) -> None:
        super().zero_block_ids(block_ids)
        torch.cuda.current_stream().wait_stream(self.side)


class DeviceIdsToSideStream(_KVBlockZeroerBase):
    """Stages each call's ids on a side stream, in device memory allocated there, for a kernel on
    the caller's stream, then drops them. The block goes back to the side stream's pool, and the
    next call's copy on the side stream may rewrite it before the caller's stream has run the
    kernel that reads it: ``record_stream`` is what ties the block to the caller's stream. Racy."""

    record = False

    def __init__(self, cache) -> None:
        super().__init__(cache)
        self.side = torch.cuda.Stream()

    def zero_block_ids(self, block_ids) -> None:
        ids = self._check(block_ids)
        if not ids:
            return
        caller = torch.cuda.current_stream()
        staged = torch.tensor(ids, dtype=torch.int64, pin_memory=True)
        with torch.cuda.stream(self.side):
            idx = torch.empty(len(ids), dtype=torch.int64, device=self.device)
            idx.copy_(staged, non_blocking=True)
        caller.wait_stream(self.side)
        self._launch(idx)
        if self.record:
            idx.record_stream(caller)


class DeviceIdsToSideStreamRecorded(DeviceIdsToSideStream):
    """The same with ``idx.record_stream(caller)``: the block waits for the caller's stream. Race-free."""

    record = True


class PageableStaging(_KVBlockZeroerBase):
    """Ids in a fresh pageable tensor, copied non-blocking: CUDA stages them before returning. Race-free."""

    def zero_block_ids(self, block_ids) -> None:
        ids = self._check(block_ids)
        if ids:
            self._launch(torch.tensor(ids, dtype=torch.int64).to(self.device, non_blocking=True))


class PersistentPageableBuffer(_KVBlockZeroerBase):
    """One persistent pageable host buffer and one persistent device buffer. The host side is safe
    (a non-blocking copy from pageable memory is staged before it returns), the device side is not:
    the next call, on whichever stream is then current, rewrites the device ids while the kernel
    queued on the previous call's stream may not have read them (contract 2). Racy."""

    def __init__(self, cache) -> None:
        super().__init__(cache)
        self.host = torch.empty(8192, dtype=torch.int64)
        self.dev = torch.empty(8192, dtype=torch.int64, device=self.device)

    def zero_block_ids(self, block_ids) -> None:
        ids = self._check(block_ids)
        if not ids:
            return
        n = len(ids)
        self.host[:n] = torch.tensor(ids)
        self.dev[:n].copy_(self.host[:n], non_blocking=True)
        self._launch(self.dev[:n])


class PageableStagingPerCallDevice(_KVBlockZeroerBase):
    """A persistent pageable host buffer, fresh device ids per call. Race-free."""

    def __init__(self, cache) -> None:
        super().__init__(cache)
        self.host = torch.empty(8192, dtype=torch.int64)

    def zero_block_ids(self, block_ids) -> None:
        ids = self._check(block_ids)
        if not ids:
            return
        n = len(ids)
        self.host[:n] = torch.tensor(ids)
        self._launch(self.host[:n].to(self.device, non_blocking=True))


class PinnedBufferSynchronized(_KVBlockZeroerBase):
    """One persistent pinned buffer, with ``event.synchronize()`` before each rewrite. Race-free."""

    def __init__(self, cache) -> None:
        super().__init__(cache)
        self.pinned = torch.empty(8192, dtype=torch.int64, pin_memory=True)
        self.dev = torch.empty(8192, dtype=torch.int64, device=self.device)
        self.done = None

    def zero_block_ids(self, block_ids) -> None:
        ids = self._check(block_ids)
        if not ids:
            return
        if self.done is not None:
            self.done.synchronize()
        n = len(ids)
        self.pinned[:n] = torch.tensor(ids)  # a torch op this time: seen directly
        self.dev[:n].copy_(self.pinned[:n], non_blocking=True)
        self._launch(self.dev[:n])
        self.done = torch.cuda.Event()
        self.done.record()


class PinnedBufferCtypes(_KVBlockZeroerBase):
    """One persistent pinned buffer written with ``ctypes.memmove``, no synchronisation. Racy."""

    def __init__(self, cache) -> None:
        super().__init__(cache)
        self.pinned = torch.empty(8192, dtype=torch.int64, pin_memory=True)
        self.dev = torch.empty(8192, dtype=torch.int64, device=self.device)

    def zero_block_ids(self, block_ids) -> None:
        ids = self._check(block_ids)
        if not ids:
            return
        n = len(ids)
        staged = (ctypes.c_int64 * n)(*ids)
        ctypes.memmove(self.pinned.data_ptr(), staged, 8 * n)
        self.dev[:n].copy_(self.pinned[:n], non_blocking=True)
        self._launch(self.dev[:n])


class TorchIndexFill:
    """No Triton: zeroes every layer's pages with ``index_fill_`` on device ids. Race-free."""

    def __init__(self, cache) -> None:
        self.cache = cache
        self.ratio = cache.spec.block_size // cache.spec.kernel_block_size
        self.num_blocks = cache.spec.num_blocks

    def zero_block_ids(self, block_ids) -> None:
        ids = [int(b) for b in (block_ids if block_ids is not None else [])]
        if not ids:
            return
        if not all(0 <= b < self.num_blocks for b in ids):
            raise ValueError(f"block id out of range: {ids}")
        rows = torch.tensor([b * self.ratio + j for b in ids for j in range(self.ratio)],
                            dtype=torch.int64, pin_memory=True).to(self.cache.device, non_blocking=True)
        for t, spec in enumerate(self.cache.spec.tensors):
            kv = self.cache.layer_tensors[spec.layers[0]]
            kv.index_fill_(1 if spec.kv_outer else 0, rows, 0)

    def warmup(self) -> None:
        self.zero_block_ids([0])


class WildKernel(FreshPinnedPerCall):
    """Aims the kernel at a table whose first address is off by a megabyte. Racy (illegal address)."""

    def __init__(self, cache) -> None:
        super().__init__(cache)
        addrs = _segments(cache)[0]
        self.seg_addrs = torch.tensor([addrs[0] + (1 << 20), *addrs[1:]], dtype=torch.uint64, device=self.device)


def factory(cls):
    def make(cache, runtime):
        return cls(cache)
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
