"""Block-table staging through ONE persistent pinned buffer. RACY: the vLLM #48085 bug.

Each step writes its block ids into the same pinned ``staging`` buffer through a numpy view and
queues ``dev_ids[:n].copy_(staging[:n], non_blocking=True)`` plus a gather from the KV cache. The
host write ``staging.numpy()[:n] = ids`` of step N+1 races with step N's still-queued H2D copy,
which may then read step N+1's ids: nothing the host observes orders the copy before the write.
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
    staging = torch.empty(MAX_IDS, dtype=torch.int64, pin_memory=True)  # persistent: reused every step
    dev_ids = torch.empty(MAX_IDS, dtype=torch.int64, device=device)
    sums = torch.zeros(steps, MAX_IDS, dtype=torch.float32, device=device)

    for step in range(steps):
        ids = block_ids(step)
        n = len(ids)
        staging.numpy()[:n] = ids  # RACE: the previous step's copy of staging may still be queued  # race: later
        dev_ids[:n].copy_(staging[:n], non_blocking=True)  # race: queued
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
