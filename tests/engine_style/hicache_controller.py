"""A hierarchical KV cache's host pool and cache controller, in the shape of SGLang's HiCache
(``memory_pool_host.py``, ``managers/cache_controller.py``).

The code under test of ``test_hicache_controller.py`` (tests/engine_style/README.md). The device
pool holds each layer's K and V per token slot; the host pool is one CPU tensor registered with
``cudaHostRegister`` (``layer_first``: K/V, layer, token, head, dim), handed out in whole pages.
The controller backs device tokens up to the host (``write``) and loads host pages back into new
device slots (``load``, ``start_loading``), each on its own stream, from a helper thread of its own
fed by a ``queue.Queue``; the thread waits for the compute stream's ``start_event`` before it
copies and acks with a ``finish_event``. The scheduler (the main thread) polls ``writing_check`` /
``loading_check``, which report the nodes whose finish event has completed and unlock their host
pages; only unlocked host pages may be evicted.

Example::

    controller = HiCacheController(allocator, host_pool)
    host_indices = controller.write(device_indices, node_id=1)
    while controller.writing_check() != [1]: ...
    new_device_indices = controller.load(host_indices, node_id=2); controller.start_loading()
    while controller.loading_check() != [2]: ...

``ENGINE_STYLE_PLANTED_RACE=1`` makes ``loading_check`` ack a load before its finish event has
completed, so its host pages can be evicted and refilled while the load still reads them
(an early-ack form of SGLang #27444); ``ENGINE_STYLE_PLANTED_RACE=27444`` is #27444 as SGLang had it:
a load is acked only once its finish event has completed, but the lock that keeps its host pages from
eviction is released as soon as the load is queued (``UnifiedRadixCache.load_back`` held only the
device lock across the async H->D copy), so host eviction may free and refill them mid-load;
``ENGINE_STYLE_PLANTED_RACE=36738`` leaves out the load stream's wait for the forward stream (where
the forward runs apart from the scheduler), so a load into slots a finished request's forward still
reads overtakes that read (SGLang #36738): the racy twins the tools must catch.

``HICACHE_IO_BACKEND`` (or ``io_backend=``) picks SGLang's io backend: ``direct`` (torch copies) or
``kernel``: ``sgl_kernel``'s kvcacheio ops, ``torch.ops.sgl_kernel.transfer_kv_per_layer`` for a
load and ``transfer_kv_all_layer`` for a write-back through the pools' ``uint64`` tables of layer
addresses, the host indices moved to the device first. Where sgl_kernel is not installed, both
tools stand its ops' reference implementations in (``racecheck.custom_ops``).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from queue import Empty, Queue

import torch

# The racy twins: "1", a load is acked, and its host pages unlocked, before its finish event (an
# early-ack form of SGLang #27444); "27444", acked on its finish event but its host pages unlocked
# once it is queued (SGLang #27444 itself; the fix holds the host lock until the finish event);
# "36738", the load stream does not wait for the forward stream's last use of the slots it fills
# (SGLang #36738; the fix: ``wait_stream(forward_stream)``).
PLANTED_RACE = os.environ.get("ENGINE_STYLE_PLANTED_RACE") == "1"
PLANTED_HOST_UNLOCKED = os.environ.get("ENGINE_STYLE_PLANTED_RACE") == "27444"
PLANTED_LOAD_UNFENCED = os.environ.get("ENGINE_STYLE_PLANTED_RACE") == "36738"
# SGLang's two io backends: "direct" (torch copies) and "kernel" (sgl_kernel's kvcacheio ops).
IO_BACKEND = os.environ.get("HICACHE_IO_BACKEND", "direct")
BLOCK_QUOTA, NUM_WARPS_PER_BLOCK = 2, 32  # the kvcacheio kernels' launch shape, as SGLang passes it


def data_ptrs(buffers: list[torch.Tensor], device: str) -> torch.Tensor:
    """Each layer's base address, as the kvcacheio all-layer kernels take them: uint64 on the device."""
    return torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64, device=device)


class MHATokenToKVPool:
    """The device KV cache: per layer, K and V of ``size + 1`` token slots (slot 0 is padding)."""

    def __init__(self, size: int, dtype: torch.dtype, head_num: int, head_dim: int, layer_num: int,
                 device: str = "cuda") -> None:
        self.size, self.dtype, self.head_num, self.head_dim, self.layer_num = size, dtype, head_num, head_dim, layer_num
        self.device = device
        self.k_buffer = [torch.zeros((size + 1, head_num, head_dim), dtype=dtype, device=device)
                         for _ in range(layer_num)]
        self.v_buffer = [torch.zeros((size + 1, head_num, head_dim), dtype=dtype, device=device)
                         for _ in range(layer_num)]
        self.k_data_ptrs, self.v_data_ptrs = data_ptrs(self.k_buffer, device), data_ptrs(self.v_buffer, device)


class TokenToKVPoolAllocator:
    """Free device slots, kept on the device as the engine's allocator keeps them."""

    def __init__(self, kvcache: MHATokenToKVPool) -> None:
        self.kvcache = kvcache
        self.free_slots = torch.arange(1, kvcache.size + 1, dtype=torch.int64, device=kvcache.device)

    def alloc(self, need_size: int) -> torch.Tensor | None:
        if need_size > len(self.free_slots):
            return None
        select, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        return select

    def free(self, indices: torch.Tensor) -> None:
        self.free_slots = torch.cat((self.free_slots, indices))


class MHATokenToKVPoolHost:
    """The host KV cache, registered with ``cudaHostRegister`` so copies to and from it are async."""

    def __init__(self, device_pool: MHATokenToKVPool, host_size: int, page_size: int,
                 io_backend: str = IO_BACKEND) -> None:
        self.device_pool, self.page_size = device_pool, page_size
        self.size = host_size - host_size % page_size
        self.layer_num = device_pool.layer_num
        self.kv_buffer = torch.empty((2, self.layer_num, self.size, device_pool.head_num, device_pool.head_dim),
                                     dtype=device_pool.dtype, device="cpu")
        result = torch.cuda.cudart().cudaHostRegister(
            self.kv_buffer.data_ptr(), self.kv_buffer.numel() * self.kv_buffer.element_size(), 0)
        if result.value != 0:
            raise RuntimeError(f"cudaHostRegister of the host KV pool failed with error code {result.value}")
        self.free_slots = torch.arange(self.size, dtype=torch.int64)
        self.locked: set[int] = set()  # pages a transfer in flight still uses (their first slots)
        self.lock = threading.RLock()
        self.init_io(io_backend)

    def init_io(self, io_backend: str) -> None:
        """The io backend, and for the kvcacheio kernels a token's bytes and the layers' host addresses."""
        if io_backend not in ("direct", "kernel"):
            raise ValueError(f"io_backend {io_backend!r}: SGLang's are 'direct' and 'kernel'")
        self.io_backend = io_backend
        pool = self.device_pool
        self.token_stride_size = pool.head_num * pool.head_dim * self.kv_buffer.element_size()
        if io_backend == "kernel":
            layers = range(self.layer_num)
            self.k_data_ptrs = data_ptrs([self.kv_buffer[0, layer] for layer in layers], pool.device)
            self.v_data_ptrs = data_ptrs([self.kv_buffer[1, layer] for layer in layers], pool.device)

    def close(self) -> None:
        torch.cuda.cudart().cudaHostUnregister(self.kv_buffer.data_ptr())

    def alloc(self, need_size: int) -> torch.Tensor | None:
        if need_size % self.page_size:
            raise ValueError(f"host pages are {self.page_size} tokens; {need_size} is not a whole number of pages")
        with self.lock:
            if need_size > len(self.free_slots):
                return None
            select, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
            return select

    def free(self, indices: torch.Tensor) -> None:
        with self.lock:
            self.free_slots = torch.cat((self.free_slots, indices))

    def pages(self, indices: torch.Tensor) -> list[int]:
        return indices[:: self.page_size].tolist()

    def protect(self, indices: torch.Tensor) -> None:
        with self.lock:
            self.locked.update(self.pages(indices))

    def release(self, indices: torch.Tensor) -> None:
        with self.lock:
            self.locked.difference_update(self.pages(indices))

    def evict(self, indices: torch.Tensor) -> bool:
        """Free ``indices``' pages unless a transfer still uses them."""
        with self.lock:
            if self.locked.intersection(self.pages(indices)):
                return False
            self.free(indices)
            return True

    def set_from_storage(self, indices: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """A prefetch from the storage tier landing in host pages: a host write, (layer, token, ...)."""
        for j, page in enumerate(self.pages(indices)):
            tokens = slice(j * self.page_size, (j + 1) * self.page_size)
            self.kv_buffer[0, :, page:page + self.page_size] = k[:, tokens]  # race: later, race[27444]: later
            self.kv_buffer[1, :, page:page + self.page_size] = v[:, tokens]

    def get_flat_data(self, indices: torch.Tensor) -> torch.Tensor:
        return self.kv_buffer[:, :, indices]

    def load_to_device_per_layer(self, host_indices: torch.Tensor, device_indices: torch.Tensor, layer_id: int) -> None:
        """Host pages into device slots on the current stream: each page into a staging tensor of this
        stream, then scattered to the slots."""
        n, pool = len(host_indices), self.device_pool
        if self.io_backend == "kernel":  # one kvcacheio kernel: token src_indices[i] to dst_indices[i], K and V
            torch.ops.sgl_kernel.transfer_kv_per_layer(  # race[36738]: later, race[27444]: queued
                src_k=self.kv_buffer[0, layer_id], dst_k=pool.k_buffer[layer_id], src_v=self.kv_buffer[1, layer_id],
                dst_v=pool.v_buffer[layer_id], src_indices=host_indices, dst_indices=device_indices,
                item_size=self.token_stride_size, block_quota=BLOCK_QUOTA, num_warps_per_block=NUM_WARPS_PER_BLOCK)
            return
        for kv, buffers in ((0, pool.k_buffer), (1, pool.v_buffer)):
            staged = torch.empty((n, pool.head_num, pool.head_dim), dtype=pool.dtype, device=pool.device)
            for j, page in enumerate(self.pages(host_indices)):
                src = self.kv_buffer[kv, layer_id, page:page + self.page_size]
                staged[j * self.page_size:(j + 1) * self.page_size].copy_(src, non_blocking=True)  # race: queued
            buffers[layer_id].index_copy_(0, device_indices, staged)

    def backup_from_device_all_layer(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        """Device slots into host pages on the current stream, every layer."""
        pool = self.device_pool
        if self.io_backend == "kernel":  # every layer at once, through the two pools' tables of layer addresses
            torch.ops.sgl_kernel.transfer_kv_all_layer(
                src_k_layers=pool.k_data_ptrs, dst_k_layers=self.k_data_ptrs, src_v_layers=pool.v_data_ptrs,
                dst_v_layers=self.v_data_ptrs, src_indices=device_indices, dst_indices=host_indices,
                item_size=self.token_stride_size, num_layers=self.layer_num, block_quota=BLOCK_QUOTA,
                num_warps_per_block=NUM_WARPS_PER_BLOCK)
            return
        for layer_id in range(self.layer_num):
            for kv, buffers in ((0, pool.k_buffer), (1, pool.v_buffer)):
                gathered = buffers[layer_id].index_select(0, device_indices)
                for j, page in enumerate(self.pages(host_indices)):
                    self.kv_buffer[kv, layer_id, page:page + self.page_size].copy_(
                        gathered[j * self.page_size:(j + 1) * self.page_size], non_blocking=True)


@dataclass
class CacheOperation:
    host_indices: torch.Tensor
    device_indices: torch.Tensor
    node_ids: list[int]
    start_event: torch.cuda.Event = field(default_factory=lambda: torch.cuda.Event())

    @staticmethod
    def merge_ops(ops: list[CacheOperation]) -> CacheOperation:
        if len(ops) == 1:
            return ops[0]
        return CacheOperation(torch.cat([op.host_indices for op in ops]), torch.cat([op.device_indices for op in ops]),
                              [node for op in ops for node in op.node_ids])


@dataclass
class HiCacheAck:
    start_event: torch.cuda.Event
    finish_event: torch.cuda.Event
    node_ids: list[int]
    host_indices: torch.Tensor


class HiCacheController:
    """See the module docstring."""

    def __init__(self, token_to_kv_pool_allocator: TokenToKVPoolAllocator, mem_pool_host: MHATokenToKVPoolHost,
                 forward_stream: torch.cuda.Stream | None = None) -> None:
        self.mem_pool_device_allocator = token_to_kv_pool_allocator
        # The stream the model's forward runs on, where it is not the scheduler's (SGLang's overlap
        # scheduler): the last reads of the device slots a load refills are queued there.
        self.forward_stream = forward_stream
        self.mem_pool_host = mem_pool_host
        self.write_stream = torch.cuda.Stream()
        self.load_stream = torch.cuda.Stream()
        self.write_queue: Queue[CacheOperation | None] = Queue()
        self.load_queue: Queue[CacheOperation | None] = Queue()
        self.ack_write_queue: Queue[HiCacheAck] = Queue()
        self.ack_load_queue: Queue[HiCacheAck] = Queue()
        self._write_acks: list[HiCacheAck] = []  # taken from the ack queues, their finish events not seen yet
        self._load_acks: list[HiCacheAck] = []
        self._pending_loads: list[CacheOperation] = []
        self.stop_event = threading.Event()
        self.write_thread = threading.Thread(target=self.write_thread_func, daemon=True)
        self.load_thread = threading.Thread(target=self.load_thread_func, daemon=True)
        self.write_thread.start()
        self.load_thread.start()

    def shutdown(self) -> None:
        self.stop_event.set()
        self.write_queue.put(None)
        self.load_queue.put(None)
        self.write_thread.join()
        self.load_thread.join()

    # -- the scheduler's side -----------------------------------------------------------------------
    def write(self, device_indices: torch.Tensor, node_id: int = -1) -> torch.Tensor | None:
        """Back ``device_indices`` up to newly allocated host pages; their host indices."""
        host_indices = self.mem_pool_host.alloc(len(device_indices))
        if host_indices is None:
            return None
        self.mem_pool_host.protect(host_indices)
        op = CacheOperation(host_indices, device_indices, [node_id])
        op.start_event.record()  # after the forward that wrote these slots
        self.write_queue.put(op)
        return host_indices

    def load(self, host_indices: torch.Tensor, node_id: int = -1) -> torch.Tensor | None:
        """Allocate device slots for ``host_indices``; ``start_loading`` copies them there."""
        device_indices = self.mem_pool_device_allocator.alloc(len(host_indices))
        if device_indices is None:
            return None
        self.mem_pool_host.protect(host_indices)
        self._pending_loads.append(CacheOperation(host_indices, device_indices, [node_id]))
        return device_indices

    def start_loading(self) -> None:
        if not self._pending_loads:
            return
        op = CacheOperation.merge_ops(self._pending_loads)
        self._pending_loads = []
        op.start_event.record()  # after the scheduler's work on these slots (their indices)
        if self.forward_stream is not None and not PLANTED_LOAD_UNFENCED:
            self.load_stream.wait_stream(self.forward_stream)  # and after the forward's last use (SGLang #36738)
        self.load_queue.put(op)
        if PLANTED_HOST_UNLOCKED:  # SGLang #27444: the host lock covered the queuing, not the copy
            self.mem_pool_host.release(op.host_indices)

    def writing_check(self) -> list[int]:
        return self._check(self.ack_write_queue, self._write_acks, planted=False)

    def loading_check(self) -> list[int]:
        return self._check(self.ack_load_queue, self._load_acks, planted=PLANTED_RACE)

    def _check(self, queue: Queue[HiCacheAck], acks: list[HiCacheAck], planted: bool) -> list[int]:
        """The nodes whose transfers have finished, in order; their host pages are unlocked."""
        while True:
            try:
                acks.append(queue.get_nowait())
            except Empty:
                break
        finished: list[int] = []
        while acks and (planted or acks[0].finish_event.query()):
            ack = acks.pop(0)
            self.mem_pool_host.release(ack.host_indices)
            finished.extend(ack.node_ids)
        return finished

    def move_indices(self, host_indices: torch.Tensor) -> torch.Tensor:
        """The kvcacheio kernels read their indices on the device (SGLang's ``move_indices``)."""
        if self.mem_pool_host.io_backend == "kernel":
            return host_indices.to(self.mem_pool_host.device_pool.device, non_blocking=True)
        return host_indices

    # -- the controller's threads -------------------------------------------------------------------
    def write_thread_func(self) -> None:
        with torch.cuda.stream(self.write_stream):
            while not self.stop_event.is_set():
                try:
                    op = self.write_queue.get(block=True, timeout=1)
                except Empty:
                    continue
                if op is None:
                    return
                finish_event = torch.cuda.Event()
                op.start_event.wait(self.write_stream)
                self.mem_pool_host.backup_from_device_all_layer(self.move_indices(op.host_indices), op.device_indices)
                finish_event.record(self.write_stream)
                op.device_indices.record_stream(self.write_stream)  # made on the compute stream
                self.ack_write_queue.put(HiCacheAck(op.start_event, finish_event, op.node_ids, op.host_indices))

    def load_thread_func(self) -> None:
        with torch.cuda.stream(self.load_stream):
            while not self.stop_event.is_set():
                try:
                    op = self.load_queue.get(block=True, timeout=1)
                except Empty:
                    continue
                if op is None:
                    return
                finish_event = torch.cuda.Event()
                op.start_event.wait(self.load_stream)
                host_indices = self.move_indices(op.host_indices)
                for layer_id in range(self.mem_pool_host.layer_num):
                    self.mem_pool_host.load_to_device_per_layer(host_indices, op.device_indices, layer_id)
                finish_event.record(self.load_stream)
                op.device_indices.record_stream(self.load_stream)
                self.ack_load_queue.put(HiCacheAck(op.start_event, finish_event, op.node_ids, op.host_indices))
