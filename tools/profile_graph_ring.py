"""Where a graph_ring call's host time goes, step by step, beside torch_per_call (H200 session 4).

    PYTHONPATH=. python3 tools/profile_graph_ring.py OUT_DIR
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from fuzz.bench.kernel.caches import bench_cache
from fuzz.bench.kernel.measure import pick_ids
from zeroer.designs import GraphRingZeroer, TorchPerCallZeroer
from zeroer.designs.graph_ring import _packer
from zeroer.cache.layout import build_cache

out = open(f"{sys.argv[1]}/profile-graph-ring.jsonl", "w")


def emit(**row):
    print(json.dumps(row), flush=True)
    out.write(json.dumps(row) + "\n")


cache = build_cache(bench_cache("llama", False), device="cuda")
torch.cuda.synchronize()
clock = time.perf_counter_ns


def timed(fn, calls=2000, sync_every=16):
    samples = []
    for i in range(calls):
        if i % sync_every == 0:
            torch.cuda.synchronize()
        t0 = clock()
        fn()
        samples.append((clock() - t0) / 1000)
    samples.sort()
    return round(statistics.median(samples), 2), round(samples[len(samples) // 10], 2), round(samples[9 * len(samples) // 10], 2)


gr, pc = GraphRingZeroer(cache), TorchPerCallZeroer(cache)
for n in (1, 16, 256):
    ids = pick_ids(n, cache.spec.num_blocks)
    for _ in range(3):  # interleaved rounds: drift on a shared host hits both alike
        emit(n=n, design="graph_ring", us=timed(lambda: gr.zero_block_ids(ids)))
        emit(n=n, design="torch_per_call", us=timed(lambda: pc.zero_block_ids(ids)))
    # The steps of one graph_ring call, timed one after another inside the call.
    steps: dict[str, list[float]] = {}
    packer = _packer(n)
    for i in range(2000):
        if i % 16 == 0:
            torch.cuda.synchronize()
        t = [clock()]
        ok = set(map(type, ids)) == {int}
        t.append(clock())
        slot = gr._acquire()
        t.append(clock())
        packer.pack_into(slot.host_np, 0, *ids)
        t.append(clock())
        low, high = gr._bounds(ids, slot, n)
        t.append(clock())
        count = 1 << (n - 1).bit_length()
        if count > n:
            slot.host_np[n:count] = -1
        t.append(clock())
        stream = gr._raw_stream(gr.index)
        t.append(clock())
        ex = slot.execs.get(count)
        if ex is None:
            ex = gr._capture(slot, count)
        t.append(clock())
        gr._graph_launch(ex, stream)
        t.append(clock())
        gr._event_record(slot.event_handle, stream)
        slot.busy = True
        t.append(clock())
        for name, a, b in zip(("types", "acquire", "pack", "bounds", "pad", "stream", "exec lookup", "cuGraphLaunch",
                               "cuEventRecord"), t, t[1:]):
            steps.setdefault(name, []).append((b - a) / 1000)
    emit(n=n, steps={k: round(statistics.median(v), 2) for k, v in steps.items()},
         total=round(sum(statistics.median(v) for v in steps.values()), 2), ok=ok and low >= 0 and high > 0)
    t0 = clock()
    for _ in range(1000):
        torch._C._cuda_getCurrentRawStream(0)
    emit(n=n, raw_stream_us=round((clock() - t0) / 1000 / 1000, 3))
torch.cuda.synchronize()
out.close()
