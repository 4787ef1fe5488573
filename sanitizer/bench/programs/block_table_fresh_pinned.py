"""Block-table staging through a FRESH pinned tensor per step. Race-free: the vLLM #48399 fix.

Twin of ``block_table_one_buffer``: each step allocates its own pinned ``staging`` tensor, writes
the ids through a numpy view and copies it non-blocking. The host never rewrites memory a queued
copy reads: the caching host allocator hands a freed block out again only once its copy is done.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

NUM_BLOCKS = 64
BLOCK_SIZE = 16
MAX_IDS = 8


def block_ids(step: int) -> np.ndarray:
    """The step's block table: 3..8 ids, different every step."""
    n = 3 + step % (MAX_IDS - 2)
    return ((step * 7 + np.arange(n) * 5) % NUM_BLOCKS).astype(np.int64)


def main(steps: int = 32) -> None:
    device = torch.device("cuda")
    kv = torch.arange(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.float32, device=device).view(NUM_BLOCKS, BLOCK_SIZE)
    dev_ids = torch.empty(MAX_IDS, dtype=torch.int64, device=device)
    sums = torch.zeros(steps, MAX_IDS, dtype=torch.float32, device=device)

    for step in range(steps):
        ids = block_ids(step)
        n = len(ids)
        staging = torch.empty(n, dtype=torch.int64, pin_memory=True)  # fresh every step
        staging.numpy()[:] = ids
        dev_ids[:n].copy_(staging, non_blocking=True)
        sums[step, :n] = kv.index_select(0, dev_ids[:n]).sum(dim=1)

    torch.cuda.synchronize()
    got = sums.cpu()
    kv_host = torch.arange(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.float32).view(NUM_BLOCKS, BLOCK_SIZE)
    for step in range(steps):
        ids = block_ids(step)
        want = kv_host[torch.from_numpy(ids)].sum(dim=1)
        if not torch.equal(got[step, :len(ids)], want):
            raise AssertionError(f"step {step}: gathered block sums {got[step, :len(ids)].tolist()} != "
                                 f"{want.tolist()} for block table {ids.tolist()}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=32)
    main(parser.parse_args().steps)
