"""LMCache #4830: pinned temporaries go back to the pinned pool while their async host-to-device copies still read them. RACY (host-write-vs-pending-copy).

Upstream: LMCache's engine-driven retrieve path scatters CPU KV chunks into the engine's paged KV
cache (``scatter_cpu_to_paged_kv``). Unpinned chunks were first staged into pinned temporaries and
copied to the device asynchronously; the temporaries were released when the function returned,
so the next group's staging took the same pinned memory and overwrote it while the earlier copies
were still in flight. Nothing failed loudly: gsm8k dropped from 0.80 to 0.00 on 8xH100. #4830
synchronizes before returning when it pinned temporaries.

Here the program's own pinned pool (one big pinned tensor carved into fixed slots with a Python
free list, as LMCache's allocator does) provides the temporaries; each retrieve scatters a group of
chunks into KV blocks and frees its slots on return. The host write ``staging.copy_(chunk)`` of the
next group races with this group's queued ``paged_kv[block_id].copy_(staging, non_blocking=True)``.
"""

from __future__ import annotations

import argparse

import torch

SLEEP_CYCLES = 20_000_000  # about 10 ms of torch.cuda._sleep on an H200
CHUNK_ELEMS = 512  # one KV chunk (one paged block's worth), flattened
CHUNKS_PER_GROUP = 2
POOL_SLOTS = 4


class PinnedPool:
    """One big pinned tensor carved into fixed slots, handed out from a free list (last freed, first reused)."""

    def __init__(self, num_slots: int, slot_elems: int) -> None:
        self.buffer = torch.zeros(num_slots * slot_elems, dtype=torch.float32, pin_memory=True)
        self.slot_elems = slot_elems
        self.free_slots = list(range(num_slots - 1, -1, -1))

    def allocate(self) -> int:
        return self.free_slots.pop()

    def view(self, slot: int) -> torch.Tensor:
        return self.buffer[slot * self.slot_elems:(slot + 1) * self.slot_elems]

    def free(self, slot: int) -> None:
        self.free_slots.append(slot)


def chunk_values(group: int, j: int) -> torch.Tensor:
    """The KV chunk ``j`` of retrieve group ``group`` (plain, unpinned CPU memory, as unpickled)."""
    return torch.arange(CHUNK_ELEMS, dtype=torch.float32) + 10000.0 * (group * CHUNKS_PER_GROUP + j + 1)


def scatter_cpu_to_paged_kv(pool: PinnedPool, chunks: list[torch.Tensor], paged_kv: torch.Tensor,
                            block_ids: list[int], sleep: bool) -> None:
    """Copy each chunk into its paged KV block, asynchronously; unpinned chunks go through the pool."""
    slots = []
    if sleep:
        torch.cuda._sleep(SLEEP_CYCLES)  # the stream is busy: the copies below run ~10 ms from now
    for chunk, block_id in zip(chunks, block_ids):
        slot = pool.allocate()
        slots.append(slot)
        staging = pool.view(slot)
        staging.copy_(chunk)  # race: later
        paged_kv[block_id].copy_(staging, non_blocking=True)  # race: queued
    for slot in slots:
        pool.free(slot)  # BUG: the copies above may still be reading these slots


def main(steps: int = 16, sleep: bool = False) -> None:
    device = torch.device("cuda")
    pool = PinnedPool(POOL_SLOTS, CHUNK_ELEMS)
    num_blocks = steps * CHUNKS_PER_GROUP
    paged_kv = torch.zeros(num_blocks, CHUNK_ELEMS, dtype=torch.float32, device=device)
    for group in range(steps):  # one retrieve per step: a group of chunks into fresh blocks
        chunks = [chunk_values(group, j) for j in range(CHUNKS_PER_GROUP)]
        block_ids = [group * CHUNKS_PER_GROUP + j for j in range(CHUNKS_PER_GROUP)]
        scatter_cpu_to_paged_kv(pool, chunks, paged_kv, block_ids, sleep)

    torch.cuda.synchronize()
    got = paged_kv.cpu()
    for block_id in range(num_blocks):
        group, j = divmod(block_id, CHUNKS_PER_GROUP)
        want = chunk_values(group, j)
        if not torch.equal(got[block_id], want):
            raise AssertionError(f"group {group}: KV block {block_id} starts {got[block_id, 0].item()}, want "
                                 f"{want[0].item()} (its pinned temporary was reused before the copy read it)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--sleep", action="store_true", help="delay the device so the race shows as wrong values")
    args = parser.parse_args()
    main(args.steps, args.sleep)
