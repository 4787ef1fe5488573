"""The code under test of tests/engine_style/, built for the fuzzer: ``factory(cache, host_pool, runtime)``.

Each factory builds one piece of engine-style transfer code, unmodified, over the harness's device
KV cache and host pool (docs/fuzz-your-offloader.md), with the thinnest adapter its shape needs:

* ``cpu_gpu_handler``: ``cpu_gpu_offload.CpuGpuOffloadingHandler`` (vLLM's ``transfer_async`` /
  ``get_finished`` / ``wait``). The harness hands ``transfer_async`` its own spec objects
  (``block_ids`` and ``medium()``), but the handler tells a store from a load by
  ``isinstance(spec, GPULoadStoreSpec)``, so the adapter rewraps each side in the handler's spec
  classes: logical block ``b`` as its ``ratio`` kernel blocks (the handler's GPU block size is the
  kernel block size) and slot ``s`` as CPU block ``s`` (its CPU block size is the logical one).
* ``hicache_controller``: ``hicache_controller.HiCacheController`` with its device pool, allocator
  and host pool (SGLang's HiCache). ``store`` is ``write``, ``load`` is ``load`` then
  ``start_loading``, ``get_finished`` is ``writing_check`` plus ``loading_check``; a job id is a
  node id, block ``b`` is device tokens ``b * block_size ..`` and slot ``s`` host tokens
  ``s * block_size ..`` (one host page). SGLang's controller allocates the slots itself; here the
  caller chooses them, so the adapter makes the caller's choice the pools' free list just before
  each call and the pools' own ``alloc`` hands it out. ``evict`` is the host pool's: it frees a
  page no transfer's lock holds, so the caller may ask for a page whose load is not yet acked.

``ENGINE_STYLE_PLANTED_RACE=1`` selects each racy twin, as for the engine-style tests::

    python -m pytest fuzz --offloader tests/engine_style/factories.py:cpu_gpu_handler --backend sim \
        --geometry tiny --host-memory pinned -p no:randomly -q
    ENGINE_STYLE_PLANTED_RACE=1 python -m pytest fuzz --offloader tests/engine_style/factories.py:hicache_controller \
        --backend sim --geometry tiny --host-memory pinned -p no:randomly -q
    ENGINE_STYLE_PLANTED_RACE=27444 python -m pytest fuzz --offloader \
        tests/engine_style/factories.py:hicache_controller_kernel --backend sim --geometry tiny --host-memory pinned -q
"""

from __future__ import annotations

import threading

import torch

# Imported by name: the fuzzer puts a factory file's directory on sys.path (zeroer/registry.py).
from cpu_gpu_offload import BLOCKS_FIRST, KV_FIRST, CpuGpuOffloadingHandler, CPULoadStoreSpec, GPULoadStoreSpec
from hicache_controller import (IO_BACKEND, HiCacheController, MHATokenToKVPool, MHATokenToKVPoolHost,
                               TokenToKVPoolAllocator, data_ptrs)
from zeroer.offload import OffloaderCapabilities


def _distinct_tensors(cache, host_pool) -> list[tuple[str, torch.Tensor, torch.Tensor, bool]]:
    """(layer, device tensor, host tensor, K/V outermost) per KV tensor, a shared tensor once."""
    out, seen = [], set()
    for spec in cache.spec.tensors:
        device = cache.layer_tensors[spec.layers[0]]
        if device.data_ptr() not in seen:
            seen.add(device.data_ptr())
            out.append((spec.layers[0], device, host_pool.layer_tensors[spec.layers[0]], spec.kv_outer))
    return out


# -- vLLM: CpuGpuOffloadingHandler -----------------------------------------------------------------

class CpuGpuHandlerAdapter:
    """``transfer_async`` with the harness's specs, passed on in the handler's spec classes."""

    def __init__(self, cache, host_pool) -> None:
        tensors = _distinct_tensors(cache, host_pool)
        layouts = {kv_outer for _, _, _, kv_outer in tensors}
        if len(layouts) != 1 or any(spec.row_padding for spec in cache.spec.tensors):
            raise ValueError(f"geometry {cache.spec.name!r}: CpuGpuOffloadingHandler takes one layout for every "
                             f"layer and unpadded rows; use one of {', '.join(HANDLER_GEOMETRIES)}")
        self.ratio = cache.spec.block_size // cache.spec.kernel_block_size
        self.handler = CpuGpuOffloadingHandler(
            {layer: device for layer, device, _, _ in tensors}, gpu_block_size=cache.spec.kernel_block_size,
            cpu_block_size=cache.spec.block_size, num_cpu_blocks=1, layout=KV_FIRST if layouts == {True} else BLOCKS_FIRST)
        # The CPU cache is the harness's host pool (the handler's own, one block, is dropped): same
        # layout, num_slots * ratio GPU-sized blocks.
        self.handler.cpu_tensors = [host for _, _, host, _ in tensors]

    def _spec(self, side) -> GPULoadStoreSpec | CPULoadStoreSpec:
        ids = side.block_ids.tolist()
        if side.medium() == "GPU":  # logical blocks -> the kernel blocks that hold them
            return GPULoadStoreSpec([b * self.ratio + k for b in ids for k in range(self.ratio)])
        return CPULoadStoreSpec(ids)

    def transfer_async(self, job_id: int, spec) -> bool:
        src, dst = spec
        return self.handler.transfer_async(job_id, (self._spec(src), self._spec(dst)))

    def get_finished(self):
        return self.handler.get_finished()

    def wait(self, job_ids: set[int]) -> None:
        self.handler.wait(job_ids)


# Every layer one layout and no row padding: not mixed_dtypes or packed, which mix K/V-outermost
# and block-outermost layers (the handler takes one layout) and pad rows.
HANDLER_GEOMETRIES = ("block_outer_fp8", "kv_outer_bf16", "mla_indexer", "ratio2", "shared_layers", "tiny")


def cpu_gpu_handler(cache, host_pool, runtime=None) -> CpuGpuHandlerAdapter:
    return CpuGpuHandlerAdapter(cache, host_pool)


cpu_gpu_handler.capabilities = OffloaderCapabilities(geometries=HANDLER_GEOMETRIES)


# -- SGLang: HiCacheController ---------------------------------------------------------------------

class HarnessDevicePool(MHATokenToKVPool):
    """The device pool over the harness's cache: per layer, K and V as (token, head, dim) views."""

    def __init__(self, cache) -> None:
        specs = cache.spec.tensors
        if len(specs) != 1 or len(specs[0].layers) != 1 or not specs[0].kv_outer or specs[0].row_padding \
                or len(specs[0].block_shape) != 3:
            raise ValueError(f"geometry {cache.spec.name!r}: the HiCache host pool is one (K/V, layer, token, head, dim) "
                             f"tensor, which only a single K/V-outermost layer of (token, head, dim) pages maps onto; "
                             f"use one of {', '.join(HICACHE_GEOMETRIES)}")
        device = cache.layer_tensors[specs[0].layers[0]]  # (2, kernel blocks, tokens, heads, dim)
        _, head_num, head_dim = specs[0].block_shape
        self.size = device.shape[1] * device.shape[2] - 1  # token 0 is SGLang's padding slot (in null block 0)
        self.dtype, self.head_num, self.head_dim, self.layer_num = device.dtype, head_num, head_dim, 1
        self.device = "cuda"
        self.k_buffer = [device[0].view(-1, head_num, head_dim)]
        self.v_buffer = [device[1].view(-1, head_num, head_dim)]
        self.k_data_ptrs, self.v_data_ptrs = data_ptrs(self.k_buffer, "cuda"), data_ptrs(self.v_buffer, "cuda")


class HarnessHostPool(MHATokenToKVPoolHost):
    """The host pool over the harness's: ``kv_buffer`` a (K/V, layer, token, head, dim) view of it,
    already pinned or registered by the harness (so not registered again, nor unregistered here)."""

    def __init__(self, device_pool: HarnessDevicePool, host_pool, page_size: int, io_backend: str) -> None:
        (host,) = host_pool.layer_tensors.values()
        self.device_pool, self.page_size = device_pool, page_size
        self.layer_num = 1
        self.kv_buffer = host.view(2, 1, -1, device_pool.head_num, device_pool.head_dim)
        self.size = self.kv_buffer.shape[2]
        self.free_slots = torch.arange(self.size, dtype=torch.int64)
        self.locked: set[int] = set()
        self.lock = threading.RLock()
        self.init_io(io_backend)

    def close(self) -> None:
        pass


class HiCacheAdapter:
    """store -> ``write``, load -> ``load`` + ``start_loading``, get_finished -> the two checks."""

    def __init__(self, cache, host_pool, io_backend: str = IO_BACKEND) -> None:
        self.block_size = cache.spec.block_size
        self.device_pool = HarnessDevicePool(cache)
        self.allocator = TokenToKVPoolAllocator(self.device_pool)
        self.host_pool = HarnessHostPool(self.device_pool, host_pool, page_size=self.block_size, io_backend=io_backend)
        self.controller = HiCacheController(self.allocator, self.host_pool)
        self.scheduler_stream = torch.cuda.Stream()

    def _tokens(self, ids: list[int]) -> list[int]:
        return [i * self.block_size + t for i in ids for t in range(self.block_size)]

    def store(self, job_id: int, block_ids: list[int], slot_ids: list[int]) -> None:
        self.host_pool.free_slots = torch.tensor(self._tokens(slot_ids), dtype=torch.int64)  # the caller's slots
        device_indices = torch.tensor(self._tokens(block_ids), dtype=torch.int64, device="cuda")
        if self.controller.write(device_indices, node_id=job_id) is None:
            raise RuntimeError(f"HiCacheController.write found no host page for job {job_id}")

    def load(self, job_id: int, slot_ids: list[int], block_ids: list[int]) -> None:
        # The caller's stream is the forward's; the scheduler's work (the slots' indices) runs on its own.
        self.controller.forward_stream = torch.cuda.current_stream()
        with torch.cuda.stream(self.scheduler_stream):
            self.allocator.free_slots = torch.tensor(self._tokens(block_ids), dtype=torch.int64, device="cuda")  # the caller's blocks
            if self.controller.load(torch.tensor(self._tokens(slot_ids), dtype=torch.int64), node_id=job_id) is None:
                raise RuntimeError(f"HiCacheController.load found no device slot for job {job_id}")
            self.controller.start_loading()

    def get_finished(self) -> list[int]:
        return self.controller.writing_check() + self.controller.loading_check()

    def evict(self, slot_ids: list[int]) -> bool:
        # The host lock is the controller's (its transfers' pages are locked until their acks), so
        # the caller asks the host pool, as SGLang's host eviction does (SGLang #27444).
        return self.host_pool.evict(torch.tensor(self._tokens(slot_ids), dtype=torch.int64))

    def close(self) -> None:
        self.controller.shutdown()


HICACHE_GEOMETRIES = ("ratio2", "tiny")


def hicache_controller(cache, host_pool, runtime=None) -> HiCacheAdapter:
    return HiCacheAdapter(cache, host_pool)


def hicache_controller_kernel(cache, host_pool, runtime=None) -> HiCacheAdapter:
    """The controller with SGLang's ``kernel`` io backend: sgl_kernel's kvcacheio ops move the bytes."""
    return HiCacheAdapter(cache, host_pool, io_backend="kernel")


hicache_controller.capabilities = OffloaderCapabilities(geometries=HICACHE_GEOMETRIES)
hicache_controller_kernel.capabilities = OffloaderCapabilities(geometries=HICACHE_GEOMETRIES)
