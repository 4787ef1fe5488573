"""One-off H200 exploration for issue 6: kernel variants against zero_(), and the host cost of
lean staging paths (torch-direct per_call, event ring, CUDA-graph ring, zero-copy).

Not part of the benchmark: it decides what to build. Writes JSON lines to OUT/explore.jsonl.

    python3 tools/h200_explore_perf.py $OUT
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import traceback

import numpy as np
import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from fuzz.bench.kernel.caches import bench_cache
from fuzz.bench.kernel.measure import pick_ids
from zeroer.kernel import _compiled, _launcher, _pointer_key, launch_config, zero_blocks
from zeroer.cache.layout import build_cache

OUT = sys.argv[1]
LOG = open(f"{OUT}/explore.jsonl", "w")


def emit(**row):
    print(json.dumps(row), flush=True)
    LOG.write(json.dumps(row) + "\n")
    LOG.flush()


def guarded(name, fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        emit(section=name, error=f"{type(exc).__name__}: {exc}", tb=traceback.format_exc()[-1500:])


@triton.jit
def _variant(addrs, strides, pages, ids, n_blocks, n_segs, max_chunks,
             BLOCK: tl.constexpr, EVICT: tl.constexpr, FLAT: tl.constexpr):
    # Aligned path only (every bench cache is aligned). FLAT: one grid axis over (seg, block, chunk)
    # work items, segment-major, grid-stride; else the production 3-D grid.
    if FLAT:
        w = tl.program_id(0)
        total = n_blocks * n_segs * max_chunks
        while w < total:
            c = w % max_chunks
            rest = w // max_chunks
            i = rest % n_blocks
            s = rest // n_blocks
            block_id = tl.load(ids + i).to(tl.int64)
            addr = tl.load(addrs + s).to(tl.int64)
            stride = tl.load(strides + s).to(tl.int64)
            page = tl.load(pages + s).to(tl.int64)
            base4 = tl.multiple_of((addr + block_id * stride * 4).to(tl.pointer_type(tl.int32)), 16)
            page4 = page // 4 * 4
            cols = tl.arange(0, BLOCK).to(tl.int64) + c.to(tl.int64) * BLOCK
            if EVICT:
                tl.store(base4 + cols, tl.full((BLOCK,), 0, tl.int32), mask=cols < page4,
                         cache_modifier=".cs")
            else:
                tl.store(base4 + cols, tl.full((BLOCK,), 0, tl.int32), mask=cols < page4)
            w += tl.num_programs(0)
    else:
        i = tl.program_id(0)
        while i < n_blocks:
            block_id = tl.load(ids + i).to(tl.int64)
            s = tl.program_id(1)
            while s < n_segs:
                addr = tl.load(addrs + s).to(tl.int64)
                stride = tl.load(strides + s).to(tl.int64)
                page = tl.load(pages + s).to(tl.int64)
                base4 = tl.multiple_of((addr + block_id * stride * 4).to(tl.pointer_type(tl.int32)), 16)
                page4 = page // 4 * 4
                c = tl.program_id(2)
                while c < max_chunks:
                    cols = tl.arange(0, BLOCK).to(tl.int64) + c.to(tl.int64) * BLOCK
                    if EVICT:
                        tl.store(base4 + cols, tl.full((BLOCK,), 0, tl.int32), mask=cols < page4,
                                 cache_modifier=".cs")
                    else:
                        tl.store(base4 + cols, tl.full((BLOCK,), 0, tl.int32), mask=cols < page4)
                    c += tl.num_programs(2)
                s += tl.num_programs(1)
            i += tl.num_programs(0)


def gpu_us(fn):
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1000.0


def host_med(fn, n=200, before=None, warm=10):
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
emit(section="versions", gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
     sms=torch.cuda.get_device_properties(0).multi_processor_count)
cache = build_cache(bench_cache("llama", False), device=dev)
torch.cuda.synchronize()
table = cache.table
BPB = 2 * 1024 * 1024


def kernel_section():
    for n in (256, 1024, 4096):
        ids = torch.tensor(pick_ids(n, 4097), dtype=torch.int64, device=dev)
        nbytes = n * BPB
        flat = torch.empty(nbytes // 4, dtype=torch.int32, device=dev)
        z = gpu_us(lambda: flat.zero_())
        emit(section="kernel", n=n, variant="zero_", us=round(z, 2), gbps=round(nbytes / z / 1e3, 1))
        del flat
        torch.cuda.empty_cache()

        def row(variant, fn):
            us = gpu_us(fn)
            emit(section="kernel", n=n, variant=variant, us=round(us, 2), gbps=round(nbytes / us / 1e3, 1),
                 ratio=round(z / us, 3))

        row("default", lambda: zero_blocks(table, ids))
        for bs, nw in ((8192, 8), (8192, 16), (4096, 16), (2048, 4), (8192, 32)):
            guarded("kernel", lambda bs=bs, nw=nw: row(f"bs{bs}w{nw}", lambda: zero_blocks(table, ids, block_size=bs, num_warps=nw)))
        sms = 132
        for bs, nw in ((8192, 8), (4096, 8), (8192, 16)):
            chunks = triton.cdiv(table.max_page, bs)
            for k in (4, 8, 16, 32):
                gx = max(1, min(n, triton.cdiv(sms * k, table.n_segs * chunks)))
                guarded("kernel", lambda bs=bs, nw=nw, gx=gx, k=k, chunks=chunks: row(
                    f"persist bs{bs}w{nw} k{k} grid({gx},{table.n_segs},{chunks})",
                    lambda: zero_blocks(table, ids, grid=(gx, table.n_segs, chunks), block_size=bs, num_warps=nw)))
        args = (table.addrs, table.block_strides, table.pages, ids, n, table.n_segs)
        for bs, nw in ((4096, 8), (8192, 8), (8192, 16)):
            chunks = triton.cdiv(table.max_page, bs)
            total = n * table.n_segs * chunks
            for evict in (0, 1):
                guarded("kernel", lambda bs=bs, nw=nw, evict=evict, chunks=chunks: row(
                    f"3d evict{evict} bs{bs}w{nw}",
                    lambda: _variant[(n, table.n_segs, chunks)](*args, chunks, BLOCK=bs, EVICT=evict, FLAT=0, num_warps=nw)))
                for g in (total, 132 * 8, 132 * 16, 132 * 32):
                    guarded("kernel", lambda bs=bs, nw=nw, evict=evict, chunks=chunks, g=g: row(
                        f"flat evict{evict} bs{bs}w{nw} grid{min(g, total)}",
                        lambda: _variant[(min(g, total), 1, 1)](*args, chunks, BLOCK=bs, EVICT=evict, FLAT=1, num_warps=nw)))


def host_section():
    # Component costs first.
    ev = torch.cuda.Event()
    ev.record()
    s = torch.cuda.current_stream()
    emit(section="host", what="Event.record()", us=host_med(lambda: ev.record()))
    emit(section="host", what="Event.record(stream)", us=host_med(lambda: ev.record(s)))
    emit(section="host", what="Event.query()", us=host_med(lambda: ev.query()))
    emit(section="host", what="current_stream()", us=host_med(torch.cuda.current_stream))
    pin = torch.empty(4096, dtype=torch.int64, pin_memory=True)
    pin_np = pin.numpy()
    d = torch.empty(4096, dtype=torch.int64, device=dev)
    for n in (1, 16, 256):
        ids = pick_ids(n, 4097)
        emit(section="host", what=f"np write {n}", us=host_med(lambda: pin_np.__setitem__(slice(0, n), ids)))
        emit(section="host", what=f"torch.tensor pinned {n}",
             us=host_med(lambda: torch.tensor(ids, dtype=torch.int64, pin_memory=True)))
        emit(section="host", what=f"copy_ nb {n}", us=host_med(lambda: d[:n].copy_(pin[:n], non_blocking=True),
                                                            before=torch.cuda.synchronize))
    # Designs, GPU idle.
    zero_blocks(table, d[:1])
    torch.cuda.synchronize()
    config = launch_config(table.max_page)

    def per_call_vllm_jit(ids):
        t = torch.tensor(ids, dtype=torch.int64, pin_memory=True)
        zero_blocks(table, t.to(dev, non_blocking=True), cached=False)

    def per_call_cached(ids):
        t = torch.tensor(ids, dtype=torch.int64, pin_memory=True)
        zero_blocks(table, t.to(dev, non_blocking=True))

    class EventRing:
        def __init__(self, slots=4, cap=4096):
            self.pins = [torch.empty(cap, dtype=torch.int64, pin_memory=True) for _ in range(slots)]
            self.nps = [p.numpy() for p in self.pins]
            self.devs = [torch.empty(cap, dtype=torch.int64, device=dev) for _ in range(slots)]
            self.evs = [None] * slots
            self.i = 0

        def __call__(self, ids):
            i = self.i
            e = self.evs[i]
            if e is not None and not e.query():
                e.synchronize()  # prototype: wait
            n = len(ids)
            self.nps[i][:n] = ids
            dv = self.devs[i][:n]
            dv.copy_(self.pins[i][:n], non_blocking=True)
            zero_blocks(table, dv)
            if e is None:
                e = self.evs[i] = torch.cuda.Event()
            e.record()
            self.i = (i + 1) % len(self.pins)

    class LeanRing(EventRing):
        # Precomputed launch: the compiled kernel called with int pointers.
        def __call__(self, ids):
            i = self.i
            e = self.evs[i]
            if e is not None and not e.query():
                e.synchronize()
            n = len(ids)
            self.nps[i][:n] = ids
            dv = self.devs[i]
            dv[:n].copy_(self.pins[i][:n], non_blocking=True)
            key = (0, config, _pointer_key(table.addrs), _pointer_key(table.block_strides),
                   _pointer_key(table.pages), True, True)
            kern = _launcher._kernels[key]
            stream = torch.cuda.current_stream().cuda_stream
            chunks = triton.cdiv(table.max_page, config.block_size)
            kern.run(n, table.n_segs, chunks, stream, kern.function, kern.packed_metadata, None, None, None,
                     table.addrs.data_ptr(), table.block_strides.data_ptr(), table.pages.data_ptr(), dv.data_ptr(),
                     n, table.n_segs, chunks, config.block_size)
            if e is None:
                e = self.evs[i] = torch.cuda.Event()
            e.record()
            self.i = (i + 1) % len(self.pins)

    class GraphRing:
        def __init__(self, slots=4, cap=256):
            self.cap = cap
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
                self.side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.side):
                    zero_blocks(table, self.devs[i][:b])  # warm the launcher key outside capture
                    g.capture_begin(capture_error_mode="thread_local")
                    self.devs[i][:b].copy_(self.pins[i][:b], non_blocking=True)
                    zero_blocks(table, self.devs[i][:b])
                    g.capture_end()
                torch.cuda.current_stream().wait_stream(self.side)
                self.graphs[(i, b)] = g
            return g

        def __call__(self, ids):
            i = self.i
            e = self.evs[i]
            if self.used[i] and not e.query():
                e.synchronize()
            n = len(ids)
            b = triton.next_power_of_2(n)
            a = self.nps[i]
            a[:n] = ids
            if b > n:
                a[n:b] = ids[-1]
            self.graph(i, b).replay()
            e.record()
            self.used[i] = True
            self.i = (i + 1) % len(self.pins)

    designs = {"per_call_vllm_jit": per_call_vllm_jit, "per_call_cached": per_call_cached}
    guarded("host", lambda: designs.__setitem__("event_ring_direct", EventRing()))
    guarded("host", lambda: designs.__setitem__("lean_ring", LeanRing()))
    guarded("host", lambda: designs.__setitem__("graph_ring", GraphRing()))
    for name, fn in designs.items():
        for n in (1, 16, 256):
            ids = pick_ids(n, 4097)

            def idle(fn=fn, ids=ids, name=name, n=n):
                emit(section="host", design=name, ids=n, gpu="idle", us=host_med(lambda: fn(ids), before=torch.cuda.synchronize))
                # correctness: poison, zero, check
                torch.cuda.synchronize()
                for seg in range(len(cache.segments)):
                    cache.pages(seg)[torch.tensor(ids, device=dev)] = 7
                torch.cuda.synchronize()
                fn(ids)
                torch.cuda.synchronize()
                ok = all(bool((cache.pages(seg)[torch.tensor(ids, device=dev)] == 0).all()) for seg in range(len(cache.segments)))
                emit(section="host", design=name, ids=n, pages_ok=ok)

            def busy(fn=fn, ids=ids, name=name, n=n):
                samples = []
                for r in range(5):
                    torch.cuda.synchronize()
                    torch.cuda._sleep(200_000 * 200)
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
                     us=(round(statistics.median(samples), 2), round(samples[len(samples) // 10], 2),
                         round(samples[9 * len(samples) // 10], 2)))

            guarded("host", idle)
            guarded("host", busy)
    # GPU time of the zero-copy idea: the kernel reading ids from pinned host memory.
    for n in (1, 256):
        ids = pick_ids(n, 4097)
        hp = torch.tensor(ids, dtype=torch.int64, pin_memory=True)
        dd = hp.to(dev)
        chunks = triton.cdiv(table.max_page, config.block_size)

        def zc(ptr):
            _compiled[(n, table.n_segs, chunks)](table.addrs, table.block_strides, table.pages, ptr, n,
                                                  table.n_segs, chunks, config.block_size, num_warps=config.num_warps)

        guarded("zerocopy", lambda: emit(section="zerocopy", n=n, device_ids_us=round(gpu_us(lambda: zc(dd)), 2),
                                         pinned_ids_us=round(gpu_us(lambda: zc(hp)), 2)))


guarded("host", host_section)
guarded("kernel", kernel_section)
emit(section="done")
