"""LMCache #4830: the scatter synchronizes its copies before its pinned temporaries go back to the pool. FIXED (twin of lmcache_4830_free_before_copy).

Upstream: LMCache's ``scatter_cpu_to_paged_kv`` staged unpinned chunks into pinned temporaries,
queued asynchronous host-to-device copies from them, and released them on return, so the next
group's staging could overwrite memory still being copied (gsm8k 0.80 -> 0.00, silently). #4830
synchronizes before returning whenever it pinned temporaries.

Same pool, the same retrieves and the same forced delay as the racy twin: an event recorded after
the group's copies is synchronized before the slots go back to the free list.
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
        staging.copy_(chunk)
        paged_kv[block_id].copy_(staging, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    copied.synchronize()  # the copies above have read the slots
    for slot in slots:
        pool.free(slot)


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
