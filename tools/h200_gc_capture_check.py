"""Can tests/test_direct.py's garbage-collector test fail? Run its scenario with graph_ring's
guard switched off (its ``gc.disable()`` made a no-op) and report what the capture does.

    PYTHONPATH=. python3 tools/h200_gc_capture_check.py
"""

from __future__ import annotations

import gc
import types

import torch

import zeroer.designs.graph_ring as graph_ring
from zeroer.cache.geometries import geometry
from zeroer.cache.layout import build_cache

cache = build_cache(geometry("kv_outer_bf16"), device="cuda")
z = graph_ring.GraphRingZeroer(cache)
old = graph_ring.GraphRingZeroer(cache)
for n in (1, 2, 4):
    old.zero_block_ids(list(range(1, n + 1)))
torch.cuda.synchronize()
old.cycle = old
del old
real = graph_ring.zero_blocks


def collecting_zero_blocks(*args, **kwargs):
    if gc.isenabled():
        gc.collect()
    real(*args, **kwargs)


graph_ring.zero_blocks = collecting_zero_blocks
graph_ring.gc = types.SimpleNamespace(isenabled=gc.isenabled, disable=lambda: None, enable=gc.enable)  # guard off
try:
    z.zero_block_ids([9])
    torch.cuda.synchronize()
    print("guard off: the capture survived a collection inside it (the test could not fail)")
except Exception as exc:  # noqa: BLE001
    print(f"guard off: the capture failed as on the H200 fuzz run: {type(exc).__name__}: {exc}")
