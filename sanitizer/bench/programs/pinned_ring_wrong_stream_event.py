"""A ring of K=2 pinned staging buffers copied on a side copy stream. RACY (a vLLM #48085 variant).

Before rewriting slot k the host synchronises ``reuse[k]``, recorded on the MAIN stream before
the slot's copy was issued on ``copy_stream``, so it does not cover it: the host write
``ring[k].numpy()[:n] = ids`` races with ``dev_ids[k, :n].copy_(ring[k][:n], non_blocking=True)``
queued on ``copy_stream`` K steps earlier. The main-stream consumer waits for the copy correctly.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

K = 2  # ring depth
NUM_BLOCKS = 64
BLOCK_SIZE = 16
MAX_IDS = 8


def block_ids(step: int) -> np.ndarray:
    """The step's block table: 3..8 ids, different every step."""
    n = 3 + step % (MAX_IDS - 2)
    return ((step * 11 + np.arange(n) * 3) % NUM_BLOCKS).astype(np.int32)


def main(steps: int = 32) -> None:
    device = torch.device("cuda")
    main_stream = torch.cuda.current_stream()
    copy_stream = torch.cuda.Stream()
    kv = torch.arange(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.float32, device=device).view(NUM_BLOCKS, BLOCK_SIZE)
    ring = [torch.empty(MAX_IDS, dtype=torch.int32, pin_memory=True) for _ in range(K)]
    reuse: list[torch.cuda.Event | None] = [None] * K  # the host waits on reuse[k] before rewriting ring[k]
    dev_ids = torch.empty(K, MAX_IDS, dtype=torch.int32, device=device)
    sums = torch.zeros(steps, MAX_IDS, dtype=torch.float32, device=device)

    for step in range(steps):
        k = step % K
        event = reuse[k]
        if event is not None:
            event.synchronize()  # waits for the main stream only: the slot's copy may still be queued
        ids = block_ids(step)
        n = len(ids)
        ring[k].numpy()[:n] = ids  # RACE: the copy on copy_stream from K steps ago may not have run  # race: later
        event = torch.cuda.Event()
        event.record()  # BUG: on the main (current) stream, before the copy is issued on copy_stream
        reuse[k] = event
        copied = torch.cuda.Event()
        copy_stream.wait_stream(main_stream)  # dev_ids[k] was read by the main stream K steps ago
        with torch.cuda.stream(copy_stream):
            dev_ids[k, :n].copy_(ring[k][:n], non_blocking=True)  # race: queued
            copied.record(copy_stream)
        main_stream.wait_event(copied)  # the consumer waits for the copy: correct
        sums[step, :n] = kv.index_select(0, dev_ids[k, :n]).sum(dim=1)

    torch.cuda.synchronize()
    got = sums.cpu()
    kv_host = torch.arange(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.float32).view(NUM_BLOCKS, BLOCK_SIZE)
    for step in range(steps):
        ids = block_ids(step)
        want = kv_host[torch.from_numpy(ids).long()].sum(dim=1)
        if not torch.equal(got[step, :len(ids)], want):
            raise AssertionError(f"step {step}: gathered block sums {got[step, :len(ids)].tolist()} != "
                                 f"{want.tolist()} for block table {ids.tolist()}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=32)
    main(parser.parse_args().steps)
