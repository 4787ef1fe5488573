"""TensorRT-LLM #15546: KV block offsets are staged through one persistent pinned tensor the next iteration overwrites. RACY (host-write-vs-pending-copy).

Upstream (nvbug 6293536; also #15607 and #16088 for the v2 manager): TensorRT-LLM's
``KVCacheManager.copy_batch_block_offsets`` filled one persistent pinned host tensor,
``host_kv_cache_block_offsets``, with the batch's block offsets and copied it to the device with
``non_blocking=True``. Under the overlap scheduler the host runs an iteration ahead, so the next
call rewrote the tensor in place before the previous iteration's copy had run (host KV offloading
stalled the stream right in front of it); attention then read another batch's blocks: memory
corruption. #15546 stages every call through a fresh host buffer.

Here an overlap-scheduler loop prepares iteration N+1 (its block offsets) before it waits for
iteration N's outputs; attention gathers KV blocks through the copied offsets. The host write
``self.host_kv_cache_block_offsets[i] = ...`` of the next iteration races with this
iteration's queued ``dst_tensor[:num_seqs].copy_(self.host_kv_cache_block_offsets[:num_seqs], non_blocking=True)``.
"""

from __future__ import annotations

import argparse

import torch

SLEEP_CYCLES = 20_000_000  # about 10 ms of torch.cuda._sleep on an H200
MAX_BATCH = 4
MAX_BLOCKS_PER_SEQ = 4
BLOCK_ELEMS = 16
SEQS_PER_ITER = 3


def batch(iteration: int) -> list[int]:
    """The request ids of ``iteration``'s batch: a sliding window (one request finishes, one joins)."""
    return [iteration + i for i in range(SEQS_PER_ITER)]


def request_blocks(request: int) -> list[int]:
    """The block offsets of ``request``'s row: its KV blocks (never shared with another request),
    padded with its first block."""
    blocks = [request * MAX_BLOCKS_PER_SEQ + j for j in range(1 + request % MAX_BLOCKS_PER_SEQ)]
    return blocks + [blocks[0]] * (MAX_BLOCKS_PER_SEQ - len(blocks))


class KVCacheManager:
    def __init__(self) -> None:
        self.host_kv_cache_block_offsets = torch.zeros(MAX_BATCH, MAX_BLOCKS_PER_SEQ, dtype=torch.int32,
                                                       pin_memory=True)  # reused by every call

    def copy_batch_block_offsets(self, dst_tensor: torch.Tensor, request_ids: list[int], sleep: bool) -> None:
        num_seqs = len(request_ids)
        for i, request in enumerate(request_ids):
            self.host_kv_cache_block_offsets[i] = torch.tensor(request_blocks(request), dtype=torch.int32)  # race: later
        if sleep:
            torch.cuda._sleep(SLEEP_CYCLES)  # the stream is stalled (host KV offloading): the copy runs ~10 ms later
        dst_tensor[:num_seqs].copy_(self.host_kv_cache_block_offsets[:num_seqs], non_blocking=True)  # race: queued


def main(steps: int = 16, sleep: bool = False) -> None:
    device = torch.device("cuda")
    num_blocks = (steps + SEQS_PER_ITER) * MAX_BLOCKS_PER_SEQ
    kv_pool = torch.arange(num_blocks * BLOCK_ELEMS, dtype=torch.float32, device=device).view(num_blocks, BLOCK_ELEMS)
    manager = KVCacheManager()
    kv_cache_block_offsets = torch.zeros(MAX_BATCH, MAX_BLOCKS_PER_SEQ, dtype=torch.int32, device=device)
    attention_out = torch.zeros(steps, MAX_BATCH, MAX_BLOCKS_PER_SEQ, dtype=torch.float32, device=device)
    previous: torch.cuda.Event | None = None

    for iteration in range(steps):
        requests = batch(iteration)
        manager.copy_batch_block_offsets(kv_cache_block_offsets, requests, sleep)
        # The forward pass: attention reads each sequence's blocks through the offsets.
        offsets = kv_cache_block_offsets[:len(requests)].long()
        attention_out[iteration, :len(requests)] = kv_pool[offsets].sum(dim=-1)
        done = torch.cuda.Event()
        done.record()
        if previous is not None:
            previous.synchronize()  # overlap: the host waits for iteration N-1 only after queuing N
        previous = done

    torch.cuda.synchronize()
    got = attention_out.cpu()
    kv_host = torch.arange(num_blocks * BLOCK_ELEMS, dtype=torch.float32).view(num_blocks, BLOCK_ELEMS).sum(dim=-1)
    for iteration in range(steps):
        for i, request in enumerate(batch(iteration)):
            want = kv_host[torch.tensor(request_blocks(request))]
            if not torch.equal(got[iteration, i], want):
                raise AssertionError(f"iteration {iteration}: request {request}'s attention read block sums "
                                     f"{got[iteration, i].tolist()}, want {want.tolist()} (another batch's blocks)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--sleep", action="store_true", help="delay the device so the race shows as wrong values")
    args = parser.parse_args()
    main(args.steps, args.sleep)
