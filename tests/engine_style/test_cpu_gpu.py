"""CPU<->GPU offloading of KV blocks, tested as vLLM tests its offloading handler
(tests/v1/kv_offload/test_cpu_gpu.py there): random caches, a random block mapping, one transfer,
polling ``get_finished`` until it reports the job, then every block of the destination checked."""

import random
import time

import numpy as np
import pytest
import torch

from cpu_gpu_offload import (BLOCKS_FIRST, KV_FIRST, CpuGpuOffloadingHandler, CPULoadStoreSpec, GPULoadStoreSpec,
                             kv_cache_shape)

NUM_GPU_BLOCKS = [16]
NUM_CPU_BLOCKS = [8]
GPU_BLOCK_SIZES = [4, 16]
GPU_BLOCKS_PER_CPU_BLOCK = [1, 3]
HEAD_SIZES = [8]
NUM_HEADS = [2]
NUM_LAYERS = [2]
LAYOUTS = [BLOCKS_FIRST, KV_FIRST]
DTYPES = [torch.bfloat16, torch.float16]
SEEDS = [0]
CUDA_DEVICES = ["cuda:0"]
NUM_MAPPINGS = [2]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def wait_for_jobs(handler: CpuGpuOffloadingHandler, job_ids: list[int], timeout: float = 10) -> list:
    finished = []
    end_time = time.time() + timeout
    while time.time() < end_time and len(finished) < len(job_ids):
        finished += handler.get_finished()
        if len(finished) < len(job_ids):
            time.sleep(0.001)
    return finished


@pytest.mark.parametrize("gpu_to_cpu", [True, False])
@pytest.mark.parametrize("num_mappings", NUM_MAPPINGS)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("num_heads", NUM_HEADS)
@pytest.mark.parametrize("gpu_block_size", GPU_BLOCK_SIZES)
@pytest.mark.parametrize("gpu_blocks_per_cpu_block", GPU_BLOCKS_PER_CPU_BLOCK)
@pytest.mark.parametrize("num_gpu_blocks", NUM_GPU_BLOCKS)
@pytest.mark.parametrize("num_cpu_blocks", NUM_CPU_BLOCKS)
@pytest.mark.parametrize("num_layers", NUM_LAYERS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("device", CUDA_DEVICES)
@torch.inference_mode()
def test_transfer(gpu_to_cpu: bool, num_mappings: int, head_size: int, num_heads: int, gpu_block_size: int,
                  gpu_blocks_per_cpu_block: int, num_gpu_blocks: int, num_cpu_blocks: int, num_layers: int,
                  layout: str, dtype: torch.dtype, seed: int, device: str) -> None:
    seed_everything(seed)

    # per-layer GPU KV caches, as the model's forward left them
    gpu_caches = {}
    for i in range(num_layers):
        shape = kv_cache_shape(layout, num_gpu_blocks, gpu_block_size, num_heads, head_size)
        gpu_caches[f"layer {i}"] = torch.rand(shape, dtype=dtype, device=device)  # race: queued

    cpu_block_size = gpu_blocks_per_cpu_block * gpu_block_size
    handler = CpuGpuOffloadingHandler(gpu_caches, gpu_block_size=gpu_block_size, cpu_block_size=cpu_block_size,
                                      num_cpu_blocks=num_cpu_blocks, layout=layout)
    for cpu_tensor in handler.cpu_tensors:  # the CPU cache holds older blocks
        cpu_tensor.uniform_()

    # select block mappings
    gpu_blocks = random.sample(range(num_gpu_blocks), num_mappings * gpu_blocks_per_cpu_block)
    cpu_blocks = random.sample(range(num_cpu_blocks), num_mappings)

    # cpu blocks in gpu block size
    cpu_blocks_in_gpu_block_size = []
    for cpu_block in cpu_blocks:
        base_block_id = cpu_block * gpu_blocks_per_cpu_block
        for i in range(gpu_blocks_per_cpu_block):
            cpu_blocks_in_gpu_block_size.append(i + base_block_id)

    # maybe skip a GPU block to test writing to the middle of a CPU block
    if gpu_to_cpu:
        gpu_blocks = gpu_blocks[gpu_blocks_per_cpu_block - 1:]
        cpu_blocks_in_gpu_block_size = cpu_blocks_in_gpu_block_size[gpu_blocks_per_cpu_block - 1:]

    if gpu_to_cpu:
        src_kv_caches, dst_kv_caches = handler.gpu_tensors, handler.cpu_tensors
        src_spec, dst_spec = GPULoadStoreSpec(gpu_blocks), CPULoadStoreSpec(cpu_blocks)
        src_blocks_in_gpu_block_size, dst_blocks_in_gpu_block_size = gpu_blocks, cpu_blocks_in_gpu_block_size
        dst_size_in_gpu_blocks = num_cpu_blocks * gpu_blocks_per_cpu_block
    else:
        src_kv_caches, dst_kv_caches = handler.cpu_tensors, handler.gpu_tensors
        src_spec, dst_spec = CPULoadStoreSpec(cpu_blocks), GPULoadStoreSpec(gpu_blocks)
        src_blocks_in_gpu_block_size, dst_blocks_in_gpu_block_size = cpu_blocks_in_gpu_block_size, gpu_blocks
        dst_size_in_gpu_blocks = num_gpu_blocks

    dst_to_src = dict(zip(dst_blocks_in_gpu_block_size, src_blocks_in_gpu_block_size))

    # clone src and dst tensors before transfer
    orig_src_caches = [x.clone() for x in src_kv_caches]
    orig_dst_caches = [x.clone() for x in dst_kv_caches]

    assert handler.transfer_async(1, (src_spec, dst_spec))
    assert set(handler.transfer_events.keys()) == {1}

    finished = wait_for_jobs(handler, [1])
    assert [(r.job_id, r.success) for r in finished] == [(1, True)]
    assert finished[0].transfer_time >= 0
    assert finished[0].transfer_size == len(dst_to_src) * num_layers * 2 * gpu_block_size * num_heads * head_size \
        * dtype.itemsize
    assert handler.transfer_events == {}

    # src tensors did not change
    for orig_tensor, tensor in zip(orig_src_caches, src_kv_caches):
        assert torch.equal(orig_tensor, tensor)

    # every destination block: the source block mapped to it, else what it held
    for dst_block in range(dst_size_in_gpu_blocks):
        src_block = dst_to_src.get(dst_block)
        for src_cache, dst_cache, orig_dst_cache, kv_dim in zip(src_kv_caches, dst_kv_caches, orig_dst_caches,
                                                                handler.kv_dim_before_num_blocks):
            for i in range(2) if kv_dim else [None]:
                pick = (lambda t, b: t[i][b]) if kv_dim else (lambda t, b: t[b])
                expected = pick(src_cache, src_block) if src_block is not None else pick(orig_dst_cache, dst_block)
                torch.testing.assert_close(pick(dst_cache, dst_block).cpu(), expected.cpu())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_transfers_finish_in_order_and_reuse_streams_and_events(layout: str, dtype: torch.dtype) -> None:
    seed_everything(0)
    gpu_caches = {"layer 0": torch.rand(kv_cache_shape(layout, 8, 4, 2, 8), dtype=dtype, device="cuda")}
    handler = CpuGpuOffloadingHandler(gpu_caches, gpu_block_size=4, cpu_block_size=4, num_cpu_blocks=8, layout=layout)
    gpu, cpu = handler.gpu_tensors[0], handler.cpu_tensors[0]
    pick = (lambda t, b: t[:, b]) if layout == KV_FIRST else (lambda t, b: t[b])

    # store blocks 1, 2 to CPU blocks 5, 6, then load them back into GPU blocks 3, 4
    assert handler.transfer_async(1, (GPULoadStoreSpec([1, 2]), CPULoadStoreSpec([5, 6])))
    assert handler.transfer_async(2, (CPULoadStoreSpec([5, 6]), GPULoadStoreSpec([3, 4])))
    handler.wait({1, 2})
    assert [(r.job_id, r.success) for r in handler.get_finished()] == [(1, True), (2, True)]
    torch.testing.assert_close(pick(cpu, 5), pick(gpu, 1).cpu())
    torch.testing.assert_close(pick(gpu, 4), pick(gpu, 2))

    # the pools hand a stream and two events out again (two streams and four events came back)
    assert handler.transfer_async(3, (GPULoadStoreSpec([0]), CPULoadStoreSpec([0])))
    assert len(handler._stream_pool) == 1 and len(handler._event_pool) == 2
    handler.wait({3})
    assert [r.job_id for r in wait_for_jobs(handler, [3])] == [3]
    torch.testing.assert_close(pick(cpu, 0), pick(gpu, 0).cpu())
