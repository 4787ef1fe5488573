"""A CPU offloading handler in the shape of vLLM's (``vllm/v1/kv_offload/worker/cpu_gpu.py``): each
transfer is one Triton kernel that copies through tables of raw addresses.

The handler builds, per job, int64 tables of source and destination addresses with numpy
(``data_ptr()`` plus block id times row stride) and of sizes in bytes, stages them with
``torch.from_numpy(...).to("cuda", non_blocking=True)`` on its transfer stream and launches
``_swap_blocks_kernel``, which loads each address from the tables and copies word by word through
them. One stream per direction, two timing events per transfer (``elapsed_time`` read once done),
an end event polled by ``get_finished``. The tools see the kernel's table-driven loads and stores
as exactly the bytes they read and write (kvdevice/intercept/kernel_accesses.py).

Racy twins (one wait missing; each marks its race's two lines ``# race[FACTORY]: queued`` on the compute
stream's write, queued first, and ``# race[FACTORY]: later`` on the transfer kernel that may overtake it):

=================  ======================================================================  =========
factory            what it does                                                            verdict
=================  ======================================================================  =========
``make``           the transfer stream waits for the compute stream before each transfer   race-free
``racy_store``     stores do not wait for the compute stream that wrote the blocks         racy
                   (vLLM #46278)
``racy_load``      loads do not wait for the compute stream's earlier use of the blocks    racy
                   (SGLang #36738)
=================  ======================================================================  =========

Fuzz it, or run the engine loop below under the sanitizer::

    python -m pytest fuzz --offloader tests/triton_swap_offload.py:make --backend sim --geometry tiny --host-memory pinned
    python -m sanitizer --backend sim -- python tests/triton_swap_offload.py            # race-free: no race
    python -m sanitizer --backend sim -- python tests/triton_swap_offload.py racy_store  # the #46278 race
"""

from __future__ import annotations

import sys

import numpy as np
import torch
import triton
import triton.language as tl

VERDICTS = {"make": "race-free", "racy_store": "racy", "racy_load": "racy"}
NUM_PROGRAMS = 4  # programs of the grid; each takes every NUM_PROGRAMS-th job
BYTES_PER_CHUNK = 64  # bytes one program copies per step


@triton.jit
def _swap_blocks_kernel(
    src_addrs,  # int64 [n_jobs]: the first byte each job reads
    dst_addrs,  # int64 [n_jobs]: the first byte each job writes
    sizes,  # int64 [n_jobs]: bytes per job, a multiple of 8
    n_jobs,  # jobs in the tables
    BYTES_PER_CHUNK: tl.constexpr,  # bytes copied per step of a program
):
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    WORDS_PER_CHUNK: tl.constexpr = BYTES_PER_CHUNK // 8
    offsets = tl.arange(0, WORDS_PER_CHUNK)
    job = pid
    while job < n_jobs:
        src = tl.load(src_addrs + job).to(tl.pointer_type(tl.int64))
        dst = tl.load(dst_addrs + job).to(tl.pointer_type(tl.int64))
        words = tl.load(sizes + job) // 8
        for start in range(0, words, WORDS_PER_CHUNK):
            idx = start + offsets
            mask = idx < words
            data = tl.load(src + idx, mask=mask, other=0)
            tl.store(dst + idx, data, mask=mask)
        job += num_progs


def _pieces(tensor: torch.Tensor, kv_outer: bool) -> list[torch.Tensor]:
    """Views whose dimension 0 is the kernel block (K and V apart for a K/V-outermost tensor)."""
    return [tensor[0], tensor[1]] if kv_outer else [tensor]


class SwapHandler:
    """One direction's transfers (vLLM's ``SingleDirectionOffloadingHandler``): ``transfer(job,
    src_blocks, dst_blocks)`` copies whole blocks from ``src`` tensors to ``dst`` tensors."""

    def __init__(self, src: list[torch.Tensor], dst: list[torch.Tensor], ratio: int, *, waits_compute: bool) -> None:
        self.ratio = ratio
        self.waits_compute = waits_compute
        self.stream = torch.cuda.Stream()
        self.jobs: list[tuple[int, torch.Event, torch.Event, tuple]] = []
        self.pairs = []  # (src base, dst base, row stride in bytes, row bytes) per piece
        for s, d in zip(src, dst):
            row = s[0].numel() * s.element_size()  # the words of a row; its padding is never copied
            if row % 8:
                raise ValueError(f"a row of {row} bytes is not a multiple of 8: the kernel copies 8-byte words")
            self.pairs.append((s.data_ptr(), d.data_ptr(), s.stride(0) * s.element_size(),
                               d.stride(0) * d.element_size(), row))

    def transfer(self, job_id: int, src_blocks: list[int], dst_blocks: list[int]) -> None:
        rows = np.arange(self.ratio, dtype=np.int64)
        src_rows = (np.asarray(src_blocks, dtype=np.int64)[:, None] * self.ratio + rows).reshape(-1)
        dst_rows = (np.asarray(dst_blocks, dtype=np.int64)[:, None] * self.ratio + rows).reshape(-1)
        src_addrs = np.concatenate([base + src_rows * stride for base, _, stride, _, _ in self.pairs])
        dst_addrs = np.concatenate([base + dst_rows * stride for _, base, _, stride, _ in self.pairs])
        sizes = np.concatenate([np.full(src_rows.size, row, dtype=np.int64) for *_, row in self.pairs])
        start, end = torch.Event(enable_timing=True), torch.Event(enable_timing=True)
        if self.waits_compute:  # the blocks' last writer or reader ran on the compute stream
            self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            tables = tuple(torch.from_numpy(a).to("cuda", non_blocking=True) for a in (src_addrs, dst_addrs, sizes))
            n = int(sizes.size)
            _swap_blocks_kernel[(min(n, NUM_PROGRAMS),)](*tables, n, BYTES_PER_CHUNK=BYTES_PER_CHUNK)  # race[racy_store]: later race[racy_load]: later
            end.record(self.stream)
        self.jobs.append((job_id, start, end, tables))  # the tables live until their kernel ran

    def finished(self) -> list[tuple[int, bool]]:
        done, still = [], []
        for job in self.jobs:
            if job[2].query():
                job[1].elapsed_time(job[2])  # vLLM reports the transfer time as a metric
                done.append((job[0], True))
            else:
                still.append(job)
        self.jobs = still
        return done

    def wait(self, job_ids: set[int]) -> None:
        for job_id, _, end, _ in self.jobs:
            if job_id in job_ids:
                end.synchronize()


class CpuGpuOffloadHandler:
    """Stores (device -> host) and loads (host -> device) as the fuzzer's offload contract calls them."""

    def __init__(self, device: list[torch.Tensor], host: list[torch.Tensor], ratio: int, *,
                 store_waits: bool = True, load_waits: bool = True) -> None:
        self.to_host = SwapHandler(device, host, ratio, waits_compute=store_waits)
        self.to_device = SwapHandler(host, device, ratio, waits_compute=load_waits)

    def store(self, job_id: int, block_ids: list[int], slot_ids: list[int]) -> None:
        self.to_host.transfer(job_id, block_ids, slot_ids)

    def load(self, job_id: int, slot_ids: list[int], block_ids: list[int]) -> None:
        self.to_device.transfer(job_id, slot_ids, block_ids)

    def get_finished(self) -> list[tuple[int, bool]]:
        return self.to_host.finished() + self.to_device.finished()

    def wait(self, job_ids: set[int]) -> None:
        self.to_host.wait(job_ids)
        self.to_device.wait(job_ids)

    def close(self) -> None:
        self.to_host.stream.synchronize()
        self.to_device.stream.synchronize()


def _tensors(cache, host_pool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The block-outermost pieces of each KV tensor, shared tensors once, device and host alike."""
    device, host, seen = [], [], set()
    for spec in cache.spec.tensors:
        tensor = cache.layer_tensors[spec.layers[0]]
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        device += _pieces(tensor, spec.kv_outer)
        host += _pieces(host_pool.layer_tensors[spec.layers[0]], spec.kv_outer)
    return device, host


def _factory(**waits: bool):
    def factory(cache, host_pool, runtime=None) -> CpuGpuOffloadHandler:
        device, host = _tensors(cache, host_pool)
        return CpuGpuOffloadHandler(device, host, cache.spec.block_size // cache.spec.kernel_block_size, **waits)
    return factory


make = _factory()
racy_store = _factory(store_waits=False)
racy_load = _factory(load_waits=False)


def main(variant: str = "make") -> None:
    """An engine loop: the model writes blocks on the compute stream, a store offloads them, the
    blocks are reused, a load brings them back, and the values are checked."""
    blocks, rows, words = 4, 2, 16
    waits = {"make": {}, "racy_store": {"store_waits": False}, "racy_load": {"load_waits": False}}[variant]
    kv = torch.zeros((2, blocks * rows, words), dtype=torch.float32, device="cuda")
    host = torch.zeros((2, blocks * rows, words), dtype=torch.float32, pin_memory=True)
    handler = CpuGpuOffloadHandler(_pieces(kv, True), _pieces(host, True), rows, **waits)
    kv[:, 0:rows].fill_(1.0)  # race[racy_store]: queued
    handler.store(1, [0], [0])
    handler.wait({1})
    kv[:, 0:rows].fill_(2.0)  # the block is reused once its store has finished
    kv[:, rows:2 * rows].fill_(3.0)  # block 1's last tenant, before the load overwrites it; race[racy_load]: queued
    handler.load(2, [0], [1])
    handler.wait({2})
    torch.cuda.synchronize()
    loaded = kv[:, rows:2 * rows].cpu()
    handler.close()
    if not bool((loaded == 1.0).all()):
        raise SystemExit(f"block 1 came back as {loaded.unique().tolist()}, not 1.0")


if __name__ == "__main__":
    main(*sys.argv[1:])
