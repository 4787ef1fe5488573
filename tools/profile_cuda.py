"""Where the time of a cuda fuzz campaign goes: per-op wall time and a cProfile of one campaign.

Run on a GPU host: ``PYTHONPATH=. python tools/profile_cuda.py OUT_DIR [seconds]``. Writes
``profile-<mode>.txt`` (top functions by total and cumulative time) and prints per-op medians.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

from fuzz.engine.campaigns import PROFILES, Campaign, run_campaign
from fuzz.engine.episode import Episode, EpisodeConfig


def per_op(mode: str) -> None:
    ops = [
        {"op": "allocate", "n": 1, "stream": 0},
        {"op": "allocate", "n": 2, "stream": 1},
        {"op": "write", "block": 1, "stream": 2},
        {"op": "read", "block": 1, "stream": 0},
        {"op": "advance", "stream": 1, "ops": 2},
        {"op": "end_step"},
        {"op": "free", "block": 2},
        {"op": "sync_device"},
    ]
    times: dict[str, list[float]] = {"construct": [], "start": [], "finish": []}
    for _ in range(15):
        t = time.perf_counter()
        episode = Episode(EpisodeConfig(zeroer="reference", backend="cuda", mode=mode))
        times["construct"].append(time.perf_counter() - t)
        t = time.perf_counter()
        episode.apply({"op": "start", "in_flight": 2})
        times["start"].append(time.perf_counter() - t)
        for op in ops:
            t = time.perf_counter()
            episode.apply(op)
            times.setdefault(op["op"], []).append(time.perf_counter() - t)
        t = time.perf_counter()
        episode.finish()
        times["finish"].append(time.perf_counter() - t)
    for name, values in times.items():
        print(f"{mode:10s} {name:10s} median {statistics.median(values) * 1e3:8.3f} ms  max {max(values) * 1e3:8.3f} ms")


def profile(mode: str, zeroer: str, expect: str, out: Path) -> None:
    campaign = Campaign(EpisodeConfig(zeroer=zeroer, backend="cuda", mode=mode), 0, expect)
    profiler = cProfile.Profile()
    profiler.enable()
    result = run_campaign(campaign, PROFILES["ci"], out / "traces")
    profiler.disable()
    rate = result.steps / result.seconds
    head = f"{campaign.id}: {result.examples} examples, {result.steps} steps, {result.seconds:.2f} s, {rate:.0f} steps/s, found={result.found}"
    print(head)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(35)
    stats.sort_stats("cumulative").print_stats(45)
    (out / f"profile-{zeroer}-{mode}.txt").write_text(head + "\n" + text.getvalue())


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for mode in ("controlled", "free"):
        per_op(mode)
    for mode in ("controlled", "free"):
        profile(mode, "reference", "clean", out)
    profile("controlled", "single_buffer", "finds", out)


if __name__ == "__main__":
    main()
