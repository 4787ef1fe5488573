"""KV reload from a CPU-side KV store through ONE pinned bounce buffer. RACY (the vLLM #48085 hazard).

Each reload fills ``bounce`` from the CPU store on the host (``bounce.copy_(cpu_store[block])``)
and queues ``gpu_kv[slot].copy_(bounce, non_blocking=True)`` plus an attention-like kernel reading
the slot. The next reload's host fill of ``bounce`` races with the previous, still-queued H2D copy,
which may then land the wrong block's KV in its slot.
"""

from __future__ import annotations

import argparse

import torch

CPU_BLOCKS = 32
GPU_SLOTS = 8
BLOCK_ELEMS = 256  # one KV block: block_size x heads x head_dim, flattened


def cpu_kv_store() -> torch.Tensor:
    """The offloaded KV blocks (a plain, unpinned CPU tensor): block b holds b*1000 + 0..255."""
    return torch.arange(BLOCK_ELEMS, dtype=torch.float32) + 1000.0 * torch.arange(CPU_BLOCKS).unsqueeze(1)


def reload_plan(step: int) -> tuple[int, int]:
    """(CPU block to reload, GPU slot to put it in) at ``step``."""
    return (step * 5 + 3) % CPU_BLOCKS, step % GPU_SLOTS


def main(steps: int = 32) -> None:
    device = torch.device("cuda")
    cpu_store = cpu_kv_store()
    bounce = torch.empty(BLOCK_ELEMS, dtype=torch.float32, pin_memory=True)  # shared by every reload
    gpu_kv = torch.zeros(GPU_SLOTS, BLOCK_ELEMS, dtype=torch.float32, device=device)
    query = torch.linspace(0.0, 1.0, BLOCK_ELEMS, dtype=torch.float32, device=device)
    scores = torch.zeros(steps, dtype=torch.float32, device=device)

    for step in range(steps):
        block, slot = reload_plan(step)
        bounce.copy_(cpu_store[block])  # RACE: the previous reload's H2D copy of bounce may be queued  # race: later
        gpu_kv[slot].copy_(bounce, non_blocking=True)  # race: queued
        scores[step] = (gpu_kv[slot] * query).sum()

    torch.cuda.synchronize()
    query_host = torch.linspace(0.0, 1.0, BLOCK_ELEMS, dtype=torch.float32)
    got_scores, got_kv = scores.cpu(), gpu_kv.cpu()
    for step in range(steps):
        block, slot = reload_plan(step)
        want = (cpu_store[block] * query_host).sum()
        if not torch.allclose(got_scores[step], want):
            raise AssertionError(f"step {step}: score over reloaded block {block} is {got_scores[step].item()}, "
                                 f"want {want.item()}")
    for slot in range(GPU_SLOTS):
        last = max((s for s in range(steps) if reload_plan(s)[1] == slot), default=None)
        if last is not None and not torch.equal(got_kv[slot], cpu_store[reload_plan(last)[0]]):
            raise AssertionError(f"GPU slot {slot} does not hold CPU block {reload_plan(last)[0]} after the reloads")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=32)
    main(parser.parse_args().steps)
