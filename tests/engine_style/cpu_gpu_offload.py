"""A CPU<->GPU offloading handler for KV blocks, in the shape of vLLM's ``kv_offload`` worker.

The code under test of ``test_cpu_gpu.py`` (tests/engine_style/README.md): written here, in the
engine's shapes, so the engine's own way of testing its transfer code can run under the sanitizer.
The GPU KV cache is one tensor per layer; the CPU cache is pinned, one tensor per layer with the
same layout, holding ``num_cpu_blocks * block_size_factor`` GPU-sized blocks. ``transfer_async``
copies blocks on a stream of its own from a pool, timed by two events from a pool;
``get_finished`` reports each job whose end event has completed, oldest first, with its transfer
time; ``wait`` blocks until the given jobs are done.

Example::

    handler = CpuGpuOffloadingHandler(gpu_caches, gpu_block_size=16, cpu_block_size=48, num_cpu_blocks=8)
    handler.transfer_async(1, (GPULoadStoreSpec([3, 4, 5]), CPULoadStoreSpec([2])))
    handler.wait({1})
    assert handler.get_finished() == [TransferResult(1, True, ...)]

``ENGINE_STYLE_PLANTED_RACE=1`` in the environment makes the store skip its wait for the compute
stream (vLLM #46278): the racy twin the sanitizer must catch. ``VLLM_OFFLOAD_COPY=swap_blocks``
moves the blocks with vLLM's C++ ``swap_blocks`` op (``torch.ops._C_cache_ops.swap_blocks``, whose
schema marks no argument written), as the handler does upstream; where vLLM is not installed the
tools stand the op's reference implementation in.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

# The racy twin: the store does not wait for the compute stream (vLLM #46278).
PLANTED_RACE = os.environ.get("ENGINE_STYLE_PLANTED_RACE") == "1"
# How the blocks move: "copy" (a copy_ per block) or "swap_blocks": vLLM's C++ op, called as
# torch.ops._C_cache_ops.swap_blocks(src, dst, block_size_in_bytes, block_mapping), once per KV
# tensor (per K and V half where K/V is the outer dimension), the mapping a CPU int64 tensor of
# (src, dst) rows made with numpy.
COPY_BACKEND = os.environ.get("VLLM_OFFLOAD_COPY", "copy")

KV_FIRST = "kv_first"  # (2, num_blocks, block_size, num_heads, head_size): FlashAttention's
BLOCKS_FIRST = "blocks_first"  # (num_blocks, 2, block_size, num_heads, head_size): FlashInfer's
LAYOUTS = (BLOCKS_FIRST, KV_FIRST)


def kv_cache_shape(layout: str, num_blocks: int, block_size: int, num_heads: int, head_size: int) -> tuple[int, ...]:
    if layout == KV_FIRST:
        return (2, num_blocks, block_size, num_heads, head_size)
    if layout == BLOCKS_FIRST:
        return (num_blocks, 2, block_size, num_heads, head_size)
    raise ValueError(f"unknown KV cache layout {layout!r} (valid: {', '.join(LAYOUTS)})")


@dataclass
class BlockIDsLoadStoreSpec:
    block_ids: np.ndarray

    def __init__(self, block_ids: list[int] | np.ndarray) -> None:
        self.block_ids = np.asarray(block_ids, dtype=np.int64)


class GPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """Blocks of the GPU cache, in GPU block size."""


class CPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """Blocks of the CPU cache, in CPU block size (``block_size_factor`` GPU blocks each)."""


@dataclass
class TransferResult:
    job_id: int
    success: bool
    transfer_size: int  # bytes
    transfer_time: float  # seconds


@dataclass
class Transfer:
    job_id: int
    stream: torch.cuda.Stream
    start_event: torch.Event
    end_event: torch.Event
    num_bytes: int


def expand_block_ids(block_ids: np.ndarray, block_size_factor: int, skip_count: int = 0) -> np.ndarray:
    """The GPU-sized blocks of ``block_ids`` of ``block_size_factor`` GPU blocks each, the first
    ``skip_count`` left out: ``expand_block_ids([0, 3], 2) -> [0, 1, 6, 7]``."""
    if not 0 <= skip_count < block_size_factor:
        raise ValueError(f"skip_count {skip_count} must be in 0..{block_size_factor - 1}")
    sub = block_ids[:, None] * block_size_factor + np.arange(block_size_factor)[None, :]
    return sub.reshape(-1)[skip_count:]


def block_views(tensor: torch.Tensor, block: int, kv_first: bool) -> list[torch.Tensor]:
    """The contiguous views of one block: its key and its value where they are apart."""
    return [tensor[0][block], tensor[1][block]] if kv_first else [tensor[block]]


class CpuGpuOffloadingHandler:
    """See the module docstring. Transfers run in the order they were submitted: each job's stream
    waits for the previous job's end event."""

    def __init__(self, gpu_caches: dict[str, torch.Tensor], gpu_block_size: int, cpu_block_size: int,
                 num_cpu_blocks: int, layout: str) -> None:
        if cpu_block_size % gpu_block_size:
            raise ValueError(f"cpu_block_size {cpu_block_size} is not a multiple of gpu_block_size {gpu_block_size}")
        self.block_size_factor = cpu_block_size // gpu_block_size
        self.kv_dim_before_num_blocks = [layout == KV_FIRST] * len(gpu_caches)
        self.gpu_tensors = list(gpu_caches.values())
        self.cpu_tensors: list[torch.Tensor] = []
        for gpu_tensor, kv_first in zip(self.gpu_tensors, self.kv_dim_before_num_blocks):
            shape = list(gpu_tensor.shape)
            shape[1 if kv_first else 0] = num_cpu_blocks * self.block_size_factor
            self.cpu_tensors.append(torch.zeros(shape, dtype=gpu_tensor.dtype, device="cpu", pin_memory=True))
        self.gpu_block_bytes = sum(t[0].nbytes if not kv else 2 * t[0][0].nbytes
                                   for t, kv in zip(self.gpu_tensors, self.kv_dim_before_num_blocks))
        self.transfer_events: dict[int, torch.Event] = {}  # job id -> its end event
        self._transfers: deque[Transfer] = deque()
        self._stream_pool: list[torch.cuda.Stream] = []
        self._event_pool: list[torch.Event] = []

    def transfer_async(self, job_id: int, spec: tuple[BlockIDsLoadStoreSpec, BlockIDsLoadStoreSpec]) -> bool:
        src_spec, dst_spec = spec
        gpu_to_cpu = isinstance(src_spec, GPULoadStoreSpec)
        if gpu_to_cpu != isinstance(dst_spec, CPULoadStoreSpec):
            raise ValueError(f"a transfer goes GPU->CPU or CPU->GPU, not {type(src_spec).__name__} -> "
                             f"{type(dst_spec).__name__}")
        if gpu_to_cpu:
            dst_ids = expand_block_ids(dst_spec.block_ids, self.block_size_factor)
            # the GPU blocks fill the CPU blocks' last sub-blocks: a store may start mid-block
            dst_ids = dst_ids[len(dst_ids) - len(src_spec.block_ids):]
            src_ids = src_spec.block_ids
            src_tensors, dst_tensors = self.gpu_tensors, self.cpu_tensors
        else:
            src_ids = expand_block_ids(src_spec.block_ids, self.block_size_factor)
            src_ids = src_ids[len(src_ids) - len(dst_spec.block_ids):]
            dst_ids = dst_spec.block_ids
            src_tensors, dst_tensors = self.cpu_tensors, self.gpu_tensors
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destination blocks")

        stream = self._stream_pool.pop() if self._stream_pool else torch.cuda.Stream()
        start_event = self._event_pool.pop() if self._event_pool else torch.Event(enable_timing=True)
        end_event = self._event_pool.pop() if self._event_pool else torch.Event(enable_timing=True)

        if not (gpu_to_cpu and PLANTED_RACE):
            # A store reads what the forward wrote, a load overwrites blocks the forward may still
            # read: both start after the compute stream's queued work (vLLM #46278).
            stream.wait_stream(torch.cuda.current_stream())
        if self._transfers:
            stream.wait_event(self._transfers[-1].end_event)  # in submission order
        with torch.cuda.stream(stream):
            start_event.record(stream)
            if COPY_BACKEND == "swap_blocks":
                src_to_dst = torch.from_numpy(np.stack([src_ids, dst_ids], axis=1))
                for src_tensor, dst_tensor, kv_first in zip(src_tensors, dst_tensors, self.kv_dim_before_num_blocks):
                    for src, dst in ([(src_tensor[0], dst_tensor[0]), (src_tensor[1], dst_tensor[1])] if kv_first
                                     else [(src_tensor, dst_tensor)]):
                        torch.ops._C_cache_ops.swap_blocks(src, dst, src[0].nbytes, src_to_dst)  # race[swap_blocks]: later
            else:
                for src_tensor, dst_tensor, kv_first in zip(src_tensors, dst_tensors, self.kv_dim_before_num_blocks):
                    for src_block, dst_block in zip(src_ids.tolist(), dst_ids.tolist()):
                        for src, dst in zip(block_views(src_tensor, src_block, kv_first),
                                            block_views(dst_tensor, dst_block, kv_first)):
                            dst.copy_(src, non_blocking=True)  # race: later
            end_event.record(stream)

        self.transfer_events[job_id] = end_event
        self._transfers.append(Transfer(job_id, stream, start_event, end_event, len(dst_ids) * self.gpu_block_bytes))
        return True

    def get_finished(self) -> list[TransferResult]:
        results = []
        while self._transfers and self._transfers[0].end_event.query():
            transfer = self._transfers.popleft()
            seconds = transfer.start_event.elapsed_time(transfer.end_event) * 1e-3  # elapsed_time is in ms
            results.append(TransferResult(transfer.job_id, True, transfer.num_bytes, seconds))
            self._stream_pool.append(transfer.stream)
            self._event_pool.extend((transfer.end_event, transfer.start_event))
            del self.transfer_events[transfer.job_id]
        return results

    def wait(self, job_ids: set[int]) -> None:
        for job_id in job_ids:
            event = self.transfer_events.get(job_id)
            if event is not None:
                event.synchronize()
