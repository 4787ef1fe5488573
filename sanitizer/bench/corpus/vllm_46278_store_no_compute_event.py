"""vLLM #46278: the CPU offload connector stores KV blocks on its own stream with no compute-done event. RACY (unordered-device-access).

Upstream (issue #45704): vLLM's SimpleCPUOffloadConnector copies finished KV blocks from the GPU
to pinned CPU blocks on a dedicated store stream. The store was queued with no event ordering it
after the compute stream's kernels that write those blocks, so it could copy a block before the
forward pass had finished writing it: the CPU cache silently kept stale or half-written KV and
later requests that hit it produced garbled output (every iteration of the issue's repro). #46278
records a compute-done event on the compute stream and makes the store stream wait on it.

Here each step the forward pass (on the current stream) writes a request's KV into reused GPU
blocks and the connector stores them to CPU blocks on ``store_stream``. The store
``cpu_kv[cpu_block].copy_(gpu_kv[gpu_block], non_blocking=True)`` on the store stream races with
the compute stream's ``gpu_kv[gpu_block].copy_(...)`` that writes the block. A GPU block is
rewritten only after the host has seen its last store complete, as the scheduler frees a block
only once its store finished.
"""

from __future__ import annotations

import argparse

import torch

SLEEP_CYCLES = 20_000_000  # about 10 ms of torch.cuda._sleep on an H200
GPU_BLOCKS = 4
BLOCK_ELEMS = 256  # one KV block: block_size x heads x head_dim, flattened
BLOCKS_PER_STEP = 2


def kv_values(step: int, j: int) -> torch.Tensor:
    """The KV the forward pass computes for block ``j`` of ``step`` (never zero, never repeated)."""
    return torch.arange(BLOCK_ELEMS, dtype=torch.float32) + 1000.0 * (step * BLOCKS_PER_STEP + j + 1)


def main(steps: int = 16, sleep: bool = False) -> None:
    device = torch.device("cuda")
    store_stream = torch.cuda.Stream()
    gpu_kv = torch.zeros(GPU_BLOCKS, BLOCK_ELEMS, dtype=torch.float32, device=device)
    cpu_kv = torch.zeros(steps * BLOCKS_PER_STEP, BLOCK_ELEMS, dtype=torch.float32, pin_memory=True)
    # The forward pass's inputs, uploaded once: what it writes into each block.
    new_kv = torch.stack([kv_values(s, j) for s in range(steps) for j in range(BLOCKS_PER_STEP)]).to(device)
    store_done: dict[int, torch.cuda.Event] = {}  # GPU block -> the event after its last store

    for step in range(steps):
        gpu_blocks = [(step * BLOCKS_PER_STEP + j) % GPU_BLOCKS for j in range(BLOCKS_PER_STEP)]
        for gpu_block in gpu_blocks:
            if gpu_block in store_done:
                store_done.pop(gpu_block).synchronize()  # the block's last store finished: it is free
        if sleep:
            torch.cuda._sleep(SLEEP_CYCLES)  # the forward pass is slow: its KV writes land ~10 ms from now
        for j, gpu_block in enumerate(gpu_blocks):  # the forward pass writes the request's KV
            gpu_kv[gpu_block].copy_(new_kv[step * BLOCKS_PER_STEP + j])  # race: queued
        # The connector launches the stores (GPU -> CPU) on its own stream.
        with torch.cuda.stream(store_stream):
            for j, gpu_block in enumerate(gpu_blocks):
                cpu_block = step * BLOCKS_PER_STEP + j
                cpu_kv[cpu_block].copy_(gpu_kv[gpu_block], non_blocking=True)  # race: later
                done = torch.cuda.Event()
                done.record(store_stream)
                store_done[gpu_block] = done

    torch.cuda.synchronize()
    for cpu_block in range(steps * BLOCKS_PER_STEP):
        step, j = divmod(cpu_block, BLOCKS_PER_STEP)
        want = kv_values(step, j)
        if not torch.equal(cpu_kv[cpu_block], want):
            first = cpu_kv[cpu_block, 0].item()
            raise AssertionError(f"step {step}: CPU block {cpu_block} holds KV starting {first}, want {want[0].item()} "
                                 f"(the store copied GPU block {(step * BLOCKS_PER_STEP + j) % GPU_BLOCKS} before "
                                 f"the forward pass wrote it)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--sleep", action="store_true", help="delay the device so the race shows as wrong values")
    args = parser.parse_args()
    main(args.steps, args.sleep)
