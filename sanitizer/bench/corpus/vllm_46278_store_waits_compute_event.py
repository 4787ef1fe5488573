"""vLLM #46278: the CPU offload store stream waits on a compute-done event. FIXED (twin of vllm_46278_store_no_compute_event).

Upstream (issue #45704): the SimpleCPUOffloadConnector's GPU-to-CPU stores ran on their own stream
with nothing ordering them after the kernels that wrote the blocks. #46278 records a compute-done
event on the compute stream each step and makes the store stream wait on it before it copies.

Same engine loop and the same forced delay as the racy twin: ``compute_done`` is recorded on the
compute stream after the forward pass's KV writes and ``store_stream.wait_event(compute_done)``
comes before the stores, so a store copies a block only after the forward pass wrote it.
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
    compute_stream = torch.cuda.current_stream()
    store_stream = torch.cuda.Stream()
    compute_done = torch.cuda.Event()  # re-recorded every step
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
            gpu_kv[gpu_block].copy_(new_kv[step * BLOCKS_PER_STEP + j])
        # The connector launches the stores (GPU -> CPU) on its own stream, after the compute.
        compute_done.record(compute_stream)
        store_stream.wait_event(compute_done)
        with torch.cuda.stream(store_stream):
            for j, gpu_block in enumerate(gpu_blocks):
                cpu_block = step * BLOCKS_PER_STEP + j
                cpu_kv[cpu_block].copy_(gpu_kv[gpu_block], non_blocking=True)
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
