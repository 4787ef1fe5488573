"""A zeroer written against the fuzzer's stream runtime, step by step: the twin of an engine's zeroer.

``examples/engine_zeroers.py`` holds zeroers written the way engine code is written; the fuzzer
intercepts their torch calls. This one does the same work as ``FreshPinnedPerCall`` there (a fresh
pinned staging buffer per call, vLLM #48399) but asks the runtime for every step, as the built-in
designs in ``zeroer/designs/`` do. Nothing is intercepted: the runtime is the zeroer's only way
to the device, which is what lets the simulator run it, the controlled mode gate it and the
happens-before checker see every access (docs/zeroer-api.md explains each call below).

Fuzz it::

    python -m pytest fuzz --zeroer examples/runtime_zeroer.py:RuntimePerCall

The ``capabilities`` declaration is what tells the fuzzer not to intercept it.
"""

from __future__ import annotations

import itertools

import torch
import triton

from engine_zeroers import MAX_CHUNK, _segments, _zero_kv_blocks_kernel  # same directory
from zeroer.protocol import Capabilities
from kvdevice.triton_cpu import launch_on_cpu


class RuntimePerCall:
    """Per call: a fresh pinned host buffer, a fresh device buffer, one copy, one kernel.

    ``runtime.host_buffer`` is pinned memory from the caching host allocator: freed, it is handed
    out again only once the copies that read it have run, so dropping it right after queueing the
    copy is safe, exactly as ``torch.tensor(..., pin_memory=True)`` is in the engine's version.
    """

    capabilities = Capabilities(api="runtime", follows_reallocation=True)

    def __init__(self, cache, runtime) -> None:
        self.cache, self.rt = cache, runtime
        self.num_blocks = cache.spec.num_blocks
        self._calls = itertools.count(1)
        self._table()

    def _table(self) -> None:
        # Read from the cache now and again whenever it moves (follows_reallocation=True).
        self._layers = {name: t.data_ptr() for name, t in self.cache.layer_tensors.items()}
        addrs, strides, pages = _segments(self.cache)
        device = self.cache.device
        self.seg_addrs = torch.tensor(addrs, dtype=torch.uint64, device=device)
        self.seg_strides = torch.tensor(strides, dtype=torch.int64, device=device)
        self.seg_pages = torch.tensor(pages, dtype=torch.int64, device=device)
        self.block_size = min(triton.next_power_of_2(max(pages)), MAX_CHUNK)
        self.chunks = triton.cdiv(max(pages), self.block_size)

    def zero_block_ids(self, block_ids) -> None:
        ids = [int(b) for b in (block_ids if block_ids is not None else [])]
        if not ids:
            return  # contract 5: an empty call enqueues nothing
        for b in ids:
            if not 0 <= b < self.num_blocks:  # contract 5: raise before anything is enqueued
                raise ValueError(f"block id {b} is out of range for a cache of {self.num_blocks} blocks "
                                 f"(valid: 0..{self.num_blocks - 1})")
        if {name: t.data_ptr() for name, t in self.cache.layer_tensors.items()} != self._layers:
            self._table()
        n = len(ids)
        # Every op enqueued inside is labelled with this call in race reports.
        with self.rt.annotate(f"runtime_per_call.zero_block_ids#{next(self._calls)}({ids})"):
            host = self.rt.host_buffer(n)  # pinned, from the caching host allocator
            self.rt.write_host(host, ids)  # the host writes it now (checked against pending copies)
            dev = self.rt.device_buffer(n, name="runtime_per_call ids")
            self.rt.copy_h2d(dev, host, n)  # queued on the current stream; reads host when it runs
            ids_view, grid = dev.tensor[:n], (n, self.seg_addrs.numel(), self.chunks)
            args = (self.seg_addrs, self.seg_strides, self.seg_pages, ids_view)

            def run() -> None:  # runs when the stream reaches it (simulator), or is issued now (cuda)
                if ids_view.is_cuda:
                    _zero_kv_blocks_kernel[grid](*args, BLOCK_SIZE=self.block_size)
                else:  # the simulator's memory is CPU memory: the same kernel, interpreted
                    launch_on_cpu(_zero_kv_blocks_kernel, grid, *args, BLOCK_SIZE=self.block_size)

            # reads: device buffers the kernel reads; blocks_written: the KV-cache blocks it zeroes.
            self.rt.launch(run, name="zero_kernel", reads=[dev], blocks_written=ids)
            self.rt.free_host(host)  # safe: the allocator keeps it until the copy has read it

    def warmup(self) -> None:
        self.zero_block_ids([0])
