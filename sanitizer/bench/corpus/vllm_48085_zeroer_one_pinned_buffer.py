"""vLLM #48085: the KV block zeroer stages block ids through one persistent pinned buffer. RACY (host-write-vs-pending-copy).

Upstream: vLLM's ``KVBlockZeroer`` zeroes newly allocated KV blocks before a request uses them. It
wrote each call's block ids into one persistent pinned buffer through its numpy view and copied
them to the device with ``non_blocking=True`` for the zeroing kernel, without waiting for that
copy. Under async scheduling the next call rewrote the buffer while the earlier copy was still
queued, so the kernel zeroed the next call's blocks and left stale KV in this call's: garbage
outputs and crashes with hybrid models and speculative decoding. #48085 fixed the race; #48399
dropped the persistent buffer for a fresh pinned tensor per call.

Here a zeroer of that shape runs in a small engine loop: every step allocates a few blocks, zeroes
them, and the "model" writes the first few slots of each block. The host write
``self._ids_np[:n] = block_ids`` of the next call races with this call's queued
``self._ids_gpu[:n].copy_(self._ids_pinned[:n], non_blocking=True)``; a block whose zeroing went
elsewhere keeps its stale tail, which the final check finds.
"""

from __future__ import annotations

import argparse

import torch

SLEEP_CYCLES = 20_000_000  # about 10 ms of torch.cuda._sleep on an H200
BLOCK_SIZE = 16  # slots per KV block
MAX_IDS = 8  # most blocks one step allocates
STALE = 7.0  # what a block holds before it was ever zeroed (what a freed block leaves behind)


def step_blocks(step: int) -> list[int]:
    """The blocks the scheduler allocates at ``step``: 3..8 of them, never handed out twice in a run."""
    n = 3 + (step * 5) % (MAX_IDS - 2)
    return [step * MAX_IDS + (i * 3) % MAX_IDS for i in range(n)]


def written_slots(step: int) -> int:
    """How many slots of each new block the model fills at ``step`` (the rest must read zero)."""
    return 1 + step % (BLOCK_SIZE // 2)


class KVBlockZeroer:
    """Zeroes KV blocks on the device, given their ids on the host (the persistent-buffer version)."""

    def __init__(self, kv_cache: torch.Tensor, max_ids: int) -> None:
        self.kv_cache = kv_cache
        self._ids_pinned = torch.zeros(max_ids, dtype=torch.int64, pin_memory=True)  # reused by every call
        self._ids_np = self._ids_pinned.numpy()
        self._ids_gpu = torch.zeros(max_ids, dtype=torch.int64, device=kv_cache.device)

    def zero_block_ids(self, block_ids: list[int], sleep: bool = False) -> None:
        n = len(block_ids)
        self._ids_np[:n] = block_ids  # race: later
        if sleep:
            torch.cuda._sleep(SLEEP_CYCLES)  # the stream is busy: the copy below runs ~10 ms from now
        self._ids_gpu[:n].copy_(self._ids_pinned[:n], non_blocking=True)  # race: queued
        self.kv_cache.index_fill_(0, self._ids_gpu[:n], 0.0)


def main(steps: int = 16, sleep: bool = False) -> None:
    device = torch.device("cuda")
    num_blocks = steps * MAX_IDS
    kv_cache = torch.full((num_blocks, BLOCK_SIZE), STALE, dtype=torch.float32, device=device)
    # The model's own block table, uploaded once: the model writes where the scheduler said.
    table = torch.zeros(steps, MAX_IDS, dtype=torch.int64)
    for step in range(steps):
        blocks = step_blocks(step)
        table[step, :len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
    block_table = table.to(device)
    zeroer = KVBlockZeroer(kv_cache, MAX_IDS)

    for step in range(steps):
        blocks = step_blocks(step)
        zeroer.zero_block_ids(blocks, sleep=sleep)
        width = written_slots(step)
        kv_cache[:, :width].index_fill_(0, block_table[step, :len(blocks)], float(step + 1))  # the "model"

    torch.cuda.synchronize()
    got = kv_cache.cpu()
    for step in range(steps):
        width = written_slots(step)
        want = torch.cat([torch.full((width,), float(step + 1)), torch.zeros(BLOCK_SIZE - width)])
        for block in step_blocks(step):
            if not torch.equal(got[block], want):
                raise AssertionError(f"step {step}: block {block} holds {got[block].tolist()}, want {want.tolist()} "
                                     f"(its zeroing went to another call's blocks)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--sleep", action="store_true", help="delay the device so the race shows as wrong values")
    args = parser.parse_args()
    main(args.steps, args.sleep)
