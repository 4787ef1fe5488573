"""H200 exploration for issue 6's kernel target: what limits zeroing scattered 32 KiB pages?

The kernel writes adjacent Llama pages at 95-98% of a contiguous ``zero_()`` but scattered ones
at 84-87% (docs/performance.md). This run separates the candidate causes, each ratio against
``zero_()`` of the same byte count measured beside it:

* id order against address set: adjacent ids 1..n, the same ids in random order, scattered ids
  sorted, and evenly spaced ids (stride 2..16: 32 KiB runs with gaps of 1..15 pages);
* the cache's footprint (address-translation reach): the same count of scattered ids in caches
  of 1, 8, 32 and 64 GiB;
* another writer on the very same pages: PyTorch's own ``index_fill_`` (one kernel per layer);
* launch order: a grid with the segment fastest (a block's 64 pages side by side in time).

    PYTHONPATH=. python3 tools/h200_scatter_ceiling.py $OUT
"""

from __future__ import annotations

import json
import random
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from fuzz.bench.kernel.caches import _llama
from fuzz.bench.kernel.measure import pick_ids
from zeroer.kernel import zero_blocks
from zeroer.cache.layout import build_cache

LOG = open(f"{sys.argv[1]}/scatter-ceiling.jsonl", "w")


def emit(**row: object) -> None:
    print(json.dumps(row), flush=True)
    LOG.write(json.dumps(row) + "\n")
    LOG.flush()


@triton.jit
def _seg_fastest(addrs, strides, pages, ids, BLOCK: tl.constexpr):
    # x = segment, y = block: the 64 pages of one block are launched next to each other.
    s = tl.program_id(0)
    block_id = tl.load(ids + tl.program_id(1)).to(tl.int64)
    addr = tl.load(addrs + s).to(tl.int64)
    stride = tl.load(strides + s).to(tl.int64)
    page = tl.load(pages + s).to(tl.int64)
    base4 = tl.multiple_of((addr + block_id * stride * 4).to(tl.pointer_type(tl.int32)), 16)
    cols = tl.arange(0, BLOCK).to(tl.int64)
    tl.store(base4 + cols, tl.full((BLOCK,), 0, tl.int32), mask=cols < page // 4 * 4)


def gpu_us(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1000.0


def zero_us(n: int) -> float:
    flat = torch.empty(n * 2**21 // 4, dtype=torch.int32, device="cuda")
    us = gpu_us(flat.zero_)
    del flat
    torch.cuda.empty_cache()
    return us


def kernel_ratio(cache, ids: list[int], z: float) -> float:
    t = cache.table
    dev = torch.tensor(ids, dtype=torch.int64, device="cuda")
    return round(z / gpu_us(lambda: zero_blocks(t, dev)), 3)


def pages_ok(cache, ids: list[int]) -> bool:
    torch.cuda.synchronize()
    dev = torch.tensor(ids, dtype=torch.int64, device="cuda")
    return all(bool(cache.pages(s)[dev].eq(0).all()) for s in range(len(cache.segments)))


emit(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
big = build_cache(_llama(32, 8, 4097), device="cuda", fill="zero")
for n in (256, 1024):
    z = zero_us(n)
    scattered = pick_ids(n, 4097)
    emit(n=n, cache_gib=8, variant="zero_ us", value=round(z, 2))
    emit(n=n, cache_gib=8, variant="scattered (bench ids)", ratio=kernel_ratio(big, scattered, z))
    emit(n=n, cache_gib=8, variant="scattered, sorted", ratio=kernel_ratio(big, sorted(scattered), z))
    adjacent = list(range(1, n + 1))
    emit(n=n, cache_gib=8, variant="adjacent 1..n", ratio=kernel_ratio(big, adjacent, z))
    shuffled = adjacent[:]
    random.Random(7).shuffle(shuffled)
    emit(n=n, cache_gib=8, variant="adjacent 1..n, random order", ratio=kernel_ratio(big, shuffled, z))
    for stride in (2, 4, 8, 16):
        if 1 + stride * (n - 1) < 4097:
            emit(n=n, cache_gib=8, variant=f"stride {stride}",
                 ratio=kernel_ratio(big, [1 + stride * k for k in range(n)], z))
    # PyTorch's own scattered writer on the same pages (what zero_blocks_reference does).
    rows = torch.tensor(scattered, dtype=torch.int64, device="cuda")

    def torch_fill() -> None:
        for t, tensor in enumerate(big.spec.tensors):
            big.word_rows(t)[:, :, : tensor.page_words].index_fill_(1, rows, 0)

    emit(n=n, cache_gib=8, variant="torch index_fill_, scattered", ratio=round(z / gpu_us(torch_fill), 3))
    t = big.table
    fn = lambda: _seg_fastest[(t.n_segs, n)](t.addrs, t.block_strides, t.pages, rows,  # noqa: E731
                                             BLOCK=8192, num_warps=16)
    emit(n=n, cache_gib=8, variant="segment-fastest grid, scattered", ratio=round(z / gpu_us(fn), 3))
    big.poison(scattered)
    fn()
    emit(n=n, cache_gib=8, variant="segment-fastest grid pages ok", value=pages_ok(big, scattered))
big = None  # frees the 8 GiB cache before the next ones
torch.cuda.empty_cache()

# The same count of scattered ids in caches of growing footprint.
for blocks, gib in ((513, 1), (16385, 32), (32769, 64)):
    cache = build_cache(_llama(32, 8, blocks), device="cuda", fill="zero")
    for n in (256, 1024):
        if n >= blocks:
            continue
        z = zero_us(n)
        ids = pick_ids(n, blocks)
        emit(n=n, cache_gib=gib, variant="scattered", ratio=kernel_ratio(cache, ids, z))
    del cache
    torch.cuda.empty_cache()
emit(done=True)
