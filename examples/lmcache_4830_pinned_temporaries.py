"""LMCache #4830 in its own shape: pinned temporaries dropped on return while a raw-pointer copy kernel still reads them.

Upstream (LMCache PR #4830, "Complete async copies before their buffers are reused"):
``scatter_cpu_to_paged_kv`` pins each unpinned chunk into a temporary (``chunk.pin_memory()``) and
launches its own host-to-device copy kernel on a transfer stream, reading the temporary through its
raw pointer, "which torch's stream tracking cannot see". Returning drops the last reference, torch's
caching host allocator hands the bytes to the next caller's ``pin_memory()``, which overwrites them
while the copies are still in flight: gsm8k 0.80 -> 0.00 on 8xH100, no error. The fix synchronizes
before returning, only when it pinned temporaries.

Here the copy kernel is a Triton kernel given the pinned temporary (Triton passes its pointer; the
allocator records an event only for ``copy_(..., non_blocking=True)``). ``--fixed`` is the twin:
the transfer stream is synchronized before the temporaries go. ``--copy`` replaces the kernel by
``copy_(non_blocking=True)``, which the allocator does track: race-free without the sync.

Run: ``python -m sanitizer --backend sim -- python examples/lmcache_4830_pinned_temporaries.py``
(exit 1, one ``host-write-vs-pending-copy``); with ``--fixed`` or ``--copy``, exit 0.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

CHUNK_ELEMS = 256  # one KV chunk (one paged block's worth), flattened
CHUNKS_PER_GROUP = 2
BLOCK = 256  # Triton block: one program copies one chunk


@triton.jit
def copy_chunk_kernel(src_ptr,  # pinned temporary (host memory the GPU reads through its pointer)
                      dst_ptr,  # the paged KV block
                      n,  # elements in the chunk
                      BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=mask), mask=mask)


def chunk_values(group: int, j: int) -> torch.Tensor:
    """Chunk ``j`` of retrieve group ``group``: unpinned CPU memory, as unpickled."""
    return torch.arange(CHUNK_ELEMS, dtype=torch.float32) + 10000.0 * (group * CHUNKS_PER_GROUP + j + 1)


def scatter_cpu_to_paged_kv(chunks: list[torch.Tensor], paged_kv: torch.Tensor, block_ids: list[int],
                            stream: torch.cuda.Stream, fixed: bool, copy: bool) -> None:
    """Copy each chunk into its paged KV block on ``stream``, through a pinned temporary."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for chunk, block_id in zip(chunks, block_ids):
            staging = chunk.pin_memory()  # race: later
            if copy:
                paged_kv[block_id].copy_(staging, non_blocking=True)
            else:
                copy_chunk_kernel[(1,)](staging, paged_kv[block_id], CHUNK_ELEMS, BLOCK=BLOCK)  # race: queued
    if fixed:
        stream.synchronize()  # the kernels have read the temporaries before they go back (#4830)
    # returning drops the temporaries: the allocator may hand their bytes to the next pin_memory()


def main(steps: int = 4, fixed: bool = False, copy: bool = False) -> None:
    stream = torch.cuda.Stream()
    paged_kv = torch.zeros(steps * CHUNKS_PER_GROUP, CHUNK_ELEMS, device="cuda")
    for group in range(steps):
        chunks = [chunk_values(group, j) for j in range(CHUNKS_PER_GROUP)]
        block_ids = [group * CHUNKS_PER_GROUP + j for j in range(CHUNKS_PER_GROUP)]
        scatter_cpu_to_paged_kv(chunks, paged_kv, block_ids, stream, fixed, copy)
    torch.cuda.synchronize()
    got = paged_kv.cpu()
    for block_id in range(steps * CHUNKS_PER_GROUP):
        want = chunk_values(*divmod(block_id, CHUNKS_PER_GROUP))
        if not torch.equal(got[block_id], want):
            raise AssertionError(f"KV block {block_id} starts {got[block_id, 0].item()}, want {want[0].item()} "
                                 "(its pinned temporary was handed out again before the copy read it)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--fixed", action="store_true", help="synchronize the transfer stream before returning")
    parser.add_argument("--copy", action="store_true", help="copy with copy_(non_blocking=True), which torch tracks")
    args = parser.parse_args()
    main(args.steps, args.fixed, args.copy)
