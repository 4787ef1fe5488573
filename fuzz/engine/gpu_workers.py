"""How many CUDA workers fit in the GPU memory free now (issue 17).

``python -m fuzz.detect --backend cuda -j 10`` once ran a 139 GiB H200 out of memory: each worker
holds a CUDA context and, for ``zoo.int32_offset_4gib``, caches of 5 GiB (twice, in an episode
with two zeroers). So the parallelism of a cuda run is sized here from what a worker needs (its
largest cache, how many caches an episode holds) and what each GPU has free, and the run says
what it chose. An out-of-memory error that still happens is a resource error
(:mod:`racecheck.resources`), never a verdict.

Example::

    plan = plan_for(16, [campaign.config for campaign in campaigns])  # EpisodeConfigs
    print(plan.describe())
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass

from zeroer.cache.geometries import geometry
from zeroer.cache.layout import CacheSpec

GIB = 1 << 30
CONTEXT_BYTES = GIB  # a worker's CUDA context, torch's allocator slack and Triton's modules
CACHE_COPIES = 3  # the raw buffers, the guard mask and the oracle's comparisons, per cache
HEADROOM = 0.9  # leave a tenth of the free memory to the driver and to everyone else

QUERY_TIMEOUT_S = 120
_QUERY = ("import json, torch; print(json.dumps([torch.cuda.mem_get_info(i)[0] "
          "for i in range(torch.cuda.device_count())]))")


def free_gpu_bytes() -> list[int]:
    """Free bytes on each visible GPU, asked in a child process so that this one creates no
    CUDA context (the workers it starts may be forked, and a context costs memory)."""
    try:
        done = subprocess.run([sys.executable, "-c", _QUERY], capture_output=True, text=True, timeout=QUERY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"could not read the free GPU memory: the query did not answer in {QUERY_TIMEOUT_S} s") from None
    if done.returncode != 0:
        raise RuntimeError(f"could not read the free GPU memory: {done.stderr.strip()[-500:]}")
    return [int(n) for n in json.loads(done.stdout.strip().splitlines()[-1])]


def worker_bytes(specs: Iterable[CacheSpec], caches: int = 1) -> int:
    """What one worker needs at most: a context, and ``caches`` copies of the largest cache."""
    largest = max((spec.device_bytes for spec in specs), default=0)
    return CONTEXT_BYTES + CACHE_COPIES * max(1, caches) * largest


@dataclass(frozen=True)
class WorkerPlan:
    requested: int
    chosen: int
    per_worker: int
    free: tuple[int, ...]

    def describe(self) -> str:
        free = " + ".join(f"{n / GIB:.0f}" for n in self.free)
        fits = "" if self.chosen == self.requested else f" (asked for {self.requested}; more would not fit)"
        return (f"GPU workers: {self.chosen}{fits}: {free} GiB free, about {self.per_worker / GIB:.1f} GiB per worker "
                f"(a CUDA context and the largest caches of the run)")


def plan_workers(requested: int, per_worker: int, free: list[int]) -> WorkerPlan:
    """The most workers, up to ``requested``, that fit when worker i runs on GPU i % len(free)
    (the round-robin of ``pytest -n`` and of the detection benchmark); at least one, which may
    still run out of memory and is then reported as a resource error."""
    if not free:
        return WorkerPlan(requested, requested, per_worker, ())
    chosen = 1
    for n in range(requested, 0, -1):
        on_each = [len(range(device, n, len(free))) for device in range(len(free))]
        if all(count * per_worker <= HEADROOM * bytes_free for count, bytes_free in zip(on_each, free)):
            chosen = n
            break
    return WorkerPlan(requested, chosen, per_worker, tuple(free))


def plan_for(requested: int, configs: Iterable) -> WorkerPlan:
    """:func:`plan_workers` for runs of these episode configs (their geometries and caches per
    episode) on the GPU memory free now."""
    configs = list(configs)
    per_worker = worker_bytes([geometry(name) for name in {c.geometry for c in configs}],
                              max((c.zeroers for c in configs), default=1))
    return plan_workers(requested, per_worker, free_gpu_bytes())
