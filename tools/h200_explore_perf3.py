"""Third H200 exploration for issue 6: does putting a page's chunks next to each other in launch
order (fewer distinct pages written at once) help the kernel on scattered pages?

    PYTHONPATH=. python3 tools/h200_explore_perf3.py $OUT
"""

from __future__ import annotations

import json
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from fuzz.bench.kernel.caches import bench_cache
from fuzz.bench.kernel.measure import pick_ids
from zeroer.kernel import zero_blocks
from zeroer.cache.layout import build_cache

LOG = open(f"{sys.argv[1]}/explore3.jsonl", "w")


def emit(**row):
    print(json.dumps(row), flush=True)
    LOG.write(json.dumps(row) + "\n")
    LOG.flush()


@triton.jit
def _ordered(addrs, strides, pages, ids, n_blocks, n_segs, max_chunks, BLOCK: tl.constexpr, ORDER: tl.constexpr):
    # ORDER 0: x = chunk, y = block, z = segment.  ORDER 1: x = chunk, y = segment, z = block.
    c = tl.program_id(0)
    if ORDER == 0:
        i = tl.program_id(1)
        s = tl.program_id(2)
    else:
        s = tl.program_id(1)
        i = tl.program_id(2)
    block_id = tl.load(ids + i).to(tl.int64)
    addr = tl.load(addrs + s).to(tl.int64)
    stride = tl.load(strides + s).to(tl.int64)
    page = tl.load(pages + s).to(tl.int64)
    base4 = tl.multiple_of((addr + block_id * stride * 4).to(tl.pointer_type(tl.int32)), 16)
    page4 = page // 4 * 4
    cols = tl.arange(0, BLOCK).to(tl.int64) + c.to(tl.int64) * BLOCK
    tl.store(base4 + cols, tl.full((BLOCK,), 0, tl.int32), mask=cols < page4)


def gpu_us(fn):
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1000.0


cache = build_cache(bench_cache("llama", False), device="cuda")
torch.cuda.synchronize()
t = cache.table
for n in (256, 4096):
    flat = torch.empty(n * 2**21 // 4, dtype=torch.int32, device="cuda")
    z = gpu_us(flat.zero_)
    del flat
    torch.cuda.empty_cache()
    ids = torch.tensor(pick_ids(n, 4097), dtype=torch.int64, device="cuda")
    emit(n=n, variant="default", ratio=round(z / gpu_us(lambda: zero_blocks(t, ids)), 3))
    for bs, nw in ((512, 1), (512, 2), (1024, 2), (1024, 4), (2048, 4), (2048, 8), (4096, 8), (8192, 16)):
        chunks = triton.cdiv(t.max_page, bs)
        for order in (0, 1):
            grid = (chunks, n, t.n_segs) if order == 0 else (chunks, t.n_segs, n)
            fn = lambda: _ordered[grid](t.addrs, t.block_strides, t.pages, ids, n, t.n_segs, chunks,  # noqa: E731
                                        BLOCK=bs, ORDER=order, num_warps=nw)
            try:
                emit(n=n, variant=f"chunk-fastest order{order} bs{bs}w{nw}", ratio=round(z / gpu_us(fn), 3))
            except Exception as exc:  # noqa: BLE001
                emit(n=n, variant=f"order{order} bs{bs}w{nw}", error=str(exc)[:300])
    # correctness of the best-looking shape on poisoned pages
    cache.poison(ids.tolist())
    chunks = triton.cdiv(t.max_page, 1024)
    _ordered[(chunks, n, t.n_segs)](t.addrs, t.block_strides, t.pages, ids, n, t.n_segs, chunks, BLOCK=1024, ORDER=0, num_warps=4)
    torch.cuda.synchronize()
    emit(n=n, pages_ok=all(bool(cache.pages(s)[ids].eq(0).all()) for s in range(len(cache.segments))))
