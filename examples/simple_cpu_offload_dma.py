"""KV offload through the CUDA driver, in vLLM SimpleCPUOffload's shape: ``cuMemcpyBatchAsync``.

vLLM's SimpleCPUOffload (``vllm/v1/simple_kv_offload``) does not copy with torch: it resolves
``cuMemcpyBatchAsync`` with ``cuda.bindings.driver.cuGetProcAddress``, wraps the pointer in a
``ctypes.CFUNCTYPE``, and calls it with numpy arrays of raw addresses (each layer's
``data_ptr()`` plus block id times bytes per block), one ``CUmemcpyAttributes`` and
``stream.cuda_stream``, from a background thread fed by a ``queue.SimpleQueue``, on low-priority
streams, appending an event per job to a list the scheduler polls. This file is that code written
again (not vLLM's), in two forms:

=====================================  =======================================================  =========
factory / program                      what it does                                             verdict
=====================================  =======================================================  =========
``dma_store_without_compute_event``    the store stream copies blocks without waiting for the   racy
                                       compute stream that wrote them (vLLM #46278)
``dma_store_after_compute_event``      the copy thread's store stream waits for an event the    race-free
                                       caller recorded on the compute stream
=====================================  =======================================================  =========

Both tools follow the driver call as they follow a ``copy_`` (docs/fuzz-your-zeroer.md, "The
engines' idioms")::

    python -m pytest fuzz --offloader examples/simple_cpu_offload_dma.py:dma_store_without_compute_event --backend sim
    python -m sanitizer --backend sim -- python examples/simple_cpu_offload_dma.py --racy   # the engine loop
"""

from __future__ import annotations

import ctypes
import queue
import sys
import threading
import time

import numpy as np
import torch

VERDICTS = {
    "dma_store_without_compute_event": "racy",
    "dma_store_after_compute_event": "race-free",
}

CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1  # the source read in stream order: the live KV cache
CU_MEMCPY_SRC_ACCESS_ORDER_ANY = 3  # may be read early: only for a stable source (the pinned pool)


class _CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class _CUmemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_uint), ("srcLocHint", _CUmemLocation),
                ("dstLocHint", _CUmemLocation), ("flags", ctypes.c_uint)]


_BATCH_MEMCPY = ctypes.CFUNCTYPE(
    ctypes.c_uint,  # CUresult
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,  # dsts, srcs, sizes
    ctypes.c_size_t,  # count
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,  # attrs, attrsIdxs, numAttrs
    ctypes.c_void_p,  # failIdx
    ctypes.c_void_p,  # hStream
)
_batch_memcpy = None  # resolved once, on first use, as the engine does


def _resolve_batch_memcpy():
    global _batch_memcpy
    if _batch_memcpy is None:
        from cuda.bindings import driver as drv

        err, ptr, _ = drv.cuGetProcAddress(b"cuMemcpyBatchAsync", 12080, 0)
        if err != drv.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuGetProcAddress(cuMemcpyBatchAsync) failed: {err}")
        _batch_memcpy = _BATCH_MEMCPY(ptr)
    return _batch_memcpy


class BatchParams:
    """Per direction: each layer's base address on both sides and its bytes per block."""

    def __init__(self, src: list[torch.Tensor], dst: list[torch.Tensor], stream, order: int) -> None:
        self.src_bases = np.array([t.data_ptr() for t in src], dtype=np.uint64)
        self.dst_bases = np.array([t.data_ptr() for t in dst], dtype=np.uint64)
        self.bpb = np.array([t.stride(0) * t.element_size() for t in src], dtype=np.uint64)
        self.attrs = _CUmemcpyAttributes(srcAccessOrder=order)
        self.attrs_idx = ctypes.c_size_t(0)
        self.fail_idx = ctypes.c_size_t(0)
        self.stream_handle = stream.cuda_stream


def copy_blocks(src_ids: list[int], dst_ids: list[int], params: BatchParams) -> None:
    """One cuMemcpyBatchAsync call: adjacent blocks merged into one run per layer."""
    fn = _resolve_batch_memcpy()
    src, dst = np.array(src_ids, dtype=np.uint64), np.array(dst_ids, dtype=np.uint64)
    adjacent = (src[1:] == src[:-1] + 1) & (dst[1:] == dst[:-1] + 1)
    starts = np.concatenate(([0], np.flatnonzero(~adjacent) + 1))
    lengths = np.diff(np.append(starts, len(src))).astype(np.uint64)
    src_all = (params.src_bases[:, None] + src[starts][None, :] * params.bpb[:, None]).ravel()
    dst_all = (params.dst_bases[:, None] + dst[starts][None, :] * params.bpb[:, None]).ravel()
    sizes = (params.bpb[:, None] * lengths[None, :]).ravel()
    err = fn(dst_all.ctypes.data, src_all.ctypes.data, sizes.ctypes.data, len(sizes),  # race[dma]: later
             ctypes.addressof(params.attrs), ctypes.byref(params.attrs_idx), 1, ctypes.byref(params.fail_idx),
             params.stream_handle)
    if err != 0:
        raise RuntimeError(f"batch memcpy failed: err={err} failIdx={params.fail_idx.value}")


class DmaCopyBackend:
    """The copy thread and its two low-priority streams; each job's event appended to ``events``."""

    def __init__(self, gpu: list[torch.Tensor], cpu: list[torch.Tensor]) -> None:
        lowest, _ = torch.cuda.Stream.priority_range()
        self.store_stream = torch.cuda.Stream(priority=lowest)
        self.load_stream = torch.cuda.Stream(priority=lowest)
        self.store_params = BatchParams(gpu, cpu, self.store_stream, CU_MEMCPY_SRC_ACCESS_ORDER_STREAM)
        self.load_params = BatchParams(cpu, gpu, self.load_stream, CU_MEMCPY_SRC_ACCESS_ORDER_ANY)
        self.events: list[tuple[int, torch.Event]] = []
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._copy_loop, name="dma-copy", daemon=True)
        self.thread.start()

    def launch_copy(self, job_id: int, src: list[int], dst: list[int], is_store: bool, wait_event=None) -> None:
        self.jobs.put((job_id, src, dst, is_store, wait_event))

    def _copy_loop(self) -> None:
        try:
            self._copy_jobs()
        except BaseException as error:  # the scheduler names it, as an engine's worker reports its failure
            self.error = error
            raise

    def _copy_jobs(self) -> None:
        while True:
            item = self.jobs.get()
            if item is None:
                return
            job_id, src, dst, is_store, wait_event = item
            stream = self.store_stream if is_store else self.load_stream
            if wait_event is not None:
                stream.wait_event(wait_event)
            copy_blocks(src, dst, self.store_params if is_store else self.load_params)
            event = torch.Event()
            event.record(stream)
            self.events.append((job_id, event))

    def shutdown(self) -> None:
        self.jobs.put(None)
        self.thread.join()


def _block_views(cache, host_pool) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """Block-outer views of every KV tensor on both sides (K and V apart), and kernel blocks per block."""
    gpu, cpu, seen = [], [], set()
    for spec in cache.spec.tensors:
        device, host = cache.layer_tensors[spec.layers[0]], host_pool.layer_tensors[spec.layers[0]]
        if device.data_ptr() in seen:
            continue
        seen.add(device.data_ptr())
        pairs = [(device[0], host[0]), (device[1], host[1])] if spec.kv_outer else [(device, host)]
        gpu += [d for d, _ in pairs]
        cpu += [h for _, h in pairs]
    return gpu, cpu, cache.spec.block_size // cache.spec.kernel_block_size


class DmaOffloader:
    """store / load / get_finished over :class:`DmaCopyBackend` (docs/offload-contract.md)."""

    def __init__(self, cache, host_pool, *, store_waits_compute: bool) -> None:
        gpu, cpu, self.ratio = _block_views(cache, host_pool)
        self.backend = DmaCopyBackend(gpu, cpu)
        self.store_waits_compute = store_waits_compute

    def _rows(self, ids: list[int]) -> list[int]:
        return [b * self.ratio + k for b in ids for k in range(self.ratio)]

    def _after_compute(self) -> torch.Event:
        event = torch.Event()
        event.record(torch.cuda.current_stream())
        return event

    def store(self, job_id: int, block_ids: list[int], slot_ids: list[int]) -> None:
        wait = self._after_compute() if self.store_waits_compute else None  # vLLM #46278
        self.backend.launch_copy(job_id, self._rows(block_ids), self._rows(slot_ids), True, wait)

    def load(self, job_id: int, slot_ids: list[int], block_ids: list[int]) -> None:
        self.backend.launch_copy(job_id, self._rows(slot_ids), self._rows(block_ids), False, self._after_compute())

    def get_finished(self) -> list[tuple[int, bool]]:
        done = [(job_id, True) for job_id, event in self.backend.events if event.query()]
        finished = {job_id for job_id, _ in done}
        self.backend.events[:] = [(j, e) for j, e in self.backend.events if j not in finished]
        return done

    def close(self) -> None:
        self.backend.shutdown()
        self.backend.store_stream.synchronize()
        self.backend.load_stream.synchronize()


def dma_store_without_compute_event(cache, host_pool, runtime=None) -> DmaOffloader:
    return DmaOffloader(cache, host_pool, store_waits_compute=False)


def dma_store_after_compute_event(cache, host_pool, runtime=None) -> DmaOffloader:
    return DmaOffloader(cache, host_pool, store_waits_compute=True)


# -- the same code as an engine loop: the forward writes a block, the step offloads it -------------------
NUM_BLOCKS, BLOCK_ELEMS, STEPS = 8, 256, 4


def engine_loop(racy: bool) -> list[float]:
    """Each step: the forward (on its own stream) writes block ``step``, then the block is stored to
    the pinned pool by the copy thread; the scheduler polls the events until every store is done."""
    kv = torch.zeros(NUM_BLOCKS, BLOCK_ELEMS, device="cuda")
    pool = torch.zeros(NUM_BLOCKS, BLOCK_ELEMS, pin_memory=True)
    backend = DmaCopyBackend([kv], [pool])
    compute = torch.cuda.Stream()
    compute.wait_stream(torch.cuda.current_stream())  # the cache's zeros were queued on the default stream
    for step in range(STEPS):
        with torch.cuda.stream(compute):
            kv[step].fill_(step + 1.0)  # race[dma]: queued
        wait = None
        if not racy:
            wait = torch.Event()
            wait.record(compute)
        backend.launch_copy(step, [step], [step], True, wait)
    finished: set[int] = set()
    deadline = time.monotonic() + 60  # the scheduler polls each step; a store that never lands is an error
    while len(finished) < STEPS and backend.thread.is_alive() and time.monotonic() < deadline:
        for job_id, event in list(backend.events):
            if event.query():
                finished.add(job_id)
        time.sleep(0.001)  # the next scheduler step (the copy thread's first call resolves the driver: slow)
    if len(finished) < STEPS:
        raise RuntimeError(f"stores {sorted(set(range(STEPS)) - finished)} never finished"
                           + (f": the copy thread failed: {backend.error!r}" if backend.error is not None else ""))
    backend.shutdown()
    return [float(pool[step, 0]) for step in range(STEPS)]


if __name__ == "__main__":
    stored = engine_loop(racy="--racy" in sys.argv)
    print("stored:", stored)
    sys.exit(0 if stored == [float(s + 1) for s in range(STEPS)] else 1)
