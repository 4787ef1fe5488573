"""Second H200 exploration for issue 6: is the kernel's gap to zero_() the scatter of the pages,
can TMA stores close it, and what does a lean CUDA-graph ring cost per call.

    PYTHONPATH=. python3 tools/h200_explore_perf2.py $OUT
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import traceback

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from fuzz.bench.kernel.caches import bench_cache
from fuzz.bench.kernel.measure import pick_ids
from zeroer.kernel import zero_blocks
from zeroer.cache.layout import build_cache

OUT = sys.argv[1]
LOG = open(f"{OUT}/explore2.jsonl", "w")


def emit(**row):
    print(json.dumps(row), flush=True)
    LOG.write(json.dumps(row) + "\n")
    LOG.flush()


def guarded(name, fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        emit(section=name, error=f"{type(exc).__name__}: {exc}"[:800], tb=traceback.format_exc()[-800:])


@triton.jit
def _tma(addrs, strides, pages, ids, n_blocks, n_segs, ROWS: tl.constexpr):
    i = tl.program_id(0)
    s = tl.program_id(1)
    c = tl.program_id(2)
    block_id = tl.load(ids + i).to(tl.int64)
    addr = tl.load(addrs + s).to(tl.int64)
    stride = tl.load(strides + s).to(tl.int64)
    page = tl.load(pages + s).to(tl.int64)
    base = (addr + block_id * stride * 4).to(tl.pointer_type(tl.int32))
    desc = tl.make_tensor_descriptor(base, shape=[page // 256, 256], strides=[256, 1], block_shape=[ROWS, 256])
    desc.store([c * ROWS, 0], tl.full((ROWS, 256), 0, tl.int32))


def gpu_us(fn):
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1000.0


def host_med(fn, n=300, before=None, warm=20):
    for _ in range(warm):
        if before:
            before()
        fn()
    out = []
    for _ in range(n):
        if before:
            before()
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1000)
    out.sort()
    return round(statistics.median(out), 2), round(out[len(out) // 10], 2), round(out[9 * len(out) // 10], 2)


dev = torch.device("cuda")
torch.cuda.set_device(0)
cache = build_cache(bench_cache("llama", False), device=dev)
torch.cuda.synchronize()
table = cache.table
BPB = 2 * 1024 * 1024


def kernel_section():
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
    for n in (256, 4096):
        nbytes = n * BPB
        flat = torch.empty(nbytes // 4, dtype=torch.int32, device=dev)
        z = gpu_us(lambda: flat.zero_())
        del flat
        torch.cuda.empty_cache()
        emit(section="kernel", n=n, variant="zero_", us=round(z, 2))
        orders = {"random": pick_ids(n, 4097)}
        orders["sorted"] = sorted(orders["random"])
        orders["contiguous"] = list(range(1, n + 1))
        for oname, lst in orders.items():
            ids = torch.tensor(lst, dtype=torch.int64, device=dev)
            for bs, nw in ((4096, 8), (8192, 16), (8192, 32)):
                guarded("kernel", lambda: emit(section="kernel", n=n, order=oname, variant=f"bs{bs}w{nw}",
                                               ratio=round(z / gpu_us(lambda: zero_blocks(table, ids, block_size=bs, num_warps=nw)), 3)))
            if oname != "random":
                continue
            for rows, nw in ((8, 4), (16, 4), (32, 4), (32, 8), (64, 4)):
                chunks = triton.cdiv(table.max_page // 256, rows)

                def tma(rows=rows, nw=nw, chunks=chunks, ids=ids):
                    _tma[(n, table.n_segs, chunks)](table.addrs, table.block_strides, table.pages, ids, n, table.n_segs,
                                                    ROWS=rows, num_warps=nw)
                guarded("kernel", lambda: emit(section="kernel", n=n, order=oname, variant=f"tma rows{rows}w{nw}",
                                               ratio=round(z / gpu_us(tma), 3)))
            # TMA correctness on a poisoned page set
            def check():
                for seg in range(len(cache.segments)):
                    cache.pages(seg)[ids] = 7
                torch.cuda.synchronize()
                _tma[(n, table.n_segs, triton.cdiv(table.max_page // 256, 32))](
                    table.addrs, table.block_strides, table.pages, ids, n, table.n_segs, ROWS=32, num_warps=4)
                torch.cuda.synchronize()
                emit(section="kernel", n=n, tma_pages_ok=all(bool((cache.pages(s)[ids] == 0).all()) for s in range(len(cache.segments))))
            guarded("kernel", check)


def host_section():
    s = torch.cuda.current_stream()
    emit(section="host", what="_cuda_getCurrentStream", us=host_med(lambda: torch._C._cuda_getCurrentStream(0)))
    emit(section="host", what="_cuda_getCurrentRawStream", us=host_med(lambda: torch._C._cuda_getCurrentRawStream(0)))
    emit(section="host", what="Event(external=True)", ok=str(torch.cuda.Event(external=True)))
    pin = torch.zeros(256, dtype=torch.int64, pin_memory=True)
    d = torch.zeros(256, dtype=torch.int64, device=dev)
    zero_blocks(table, d[:1])
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        g.capture_begin(capture_error_mode="thread_local")
        d[:1].copy_(pin[:1], non_blocking=True)
        zero_blocks(table, d[:1])
        g.capture_end()
    emit(section="host", what="CUDAGraph.replay() idle", us=host_med(g.replay, before=torch.cuda.synchronize))
    streams = {}

    def stream_obj():
        key = torch._C._cuda_getCurrentStream(0)
        st = streams.get(key)
        if st is None:
            st = streams[key] = torch.cuda.current_stream()
        return st

    emit(section="host", what="cached stream lookup", us=host_med(stream_obj))
    ev = torch.cuda.Event()
    emit(section="host", what="ev.record(cached stream)", us=host_med(lambda: ev.record(stream_obj())))

    class GraphRing:
        def __init__(self, slots=64, cap=256):
            self.pins = [torch.zeros(cap, dtype=torch.int64, pin_memory=True) for _ in range(slots)]
            self.nps = [p.numpy() for p in self.pins]
            self.devs = [torch.zeros(cap, dtype=torch.int64, device=dev) for _ in range(slots)]
            self.evs = [torch.cuda.Event() for _ in range(slots)]
            self.used = [False] * slots
            self.graphs = {}
            self.i = 0
            self.side = torch.cuda.Stream()

        def graph(self, i, b):
            g = self.graphs.get((i, b))
            if g is None:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.stream(self.side):
                    g.capture_begin(capture_error_mode="thread_local")
                    self.devs[i][:b].copy_(self.pins[i][:b], non_blocking=True)
                    zero_blocks(table, self.devs[i][:b])
                    g.capture_end()
                self.graphs[(i, b)] = g
            return g

        def __call__(self, ids):
            i = self.i
            if self.used[i] and not self.evs[i].query():
                self.evs[i].synchronize()
            n = len(ids)
            b = 1 << (n - 1).bit_length()
            a = self.nps[i]
            a[:n] = ids
            if b > n:
                a[n:b] = ids[-1]
            self.graph(i, b).replay()
            self.evs[i].record(stream_obj())
            self.used[i] = True
            self.i = (i + 1) % len(self.pins)

    def per_call_cached(ids):
        t = torch.tensor(ids, dtype=torch.int64, pin_memory=True)
        zero_blocks(table, t.to(dev, non_blocking=True))

    gr = GraphRing()
    for n in (1, 16, 256):
        ids = pick_ids(n, 4097)
        for b in range(64):  # capture every slot's graph first
            gr(ids)
        torch.cuda.synchronize()
        for name, fn in (("per_call_cached", per_call_cached), ("graph_ring_v2", gr)):
            guarded("host", lambda: emit(section="host", design=name, ids=n, gpu="idle",
                                         us=host_med(lambda: fn(ids), before=torch.cuda.synchronize)))

            def busy():
                samples = []
                for r in range(5):
                    torch.cuda.synchronize()
                    torch.cuda._sleep(200_000 * 20)
                    got = []
                    for _ in range(32):
                        t0 = time.perf_counter_ns()
                        fn(ids)
                        got.append((time.perf_counter_ns() - t0) / 1000)
                    still = not torch.cuda.current_stream().query()
                    if r:
                        samples += got
                samples.sort()
                emit(section="host", design=name, ids=n, gpu="busy", busy_at_end=still,
                     us=(round(statistics.median(samples), 2), round(samples[len(samples) // 10], 2)))
            guarded("host", busy)


guarded("host", host_section)
guarded("kernel", kernel_section)
emit(section="done")
