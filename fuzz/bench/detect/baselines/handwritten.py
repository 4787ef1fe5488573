"""Baseline (d): one hand-written interleaving in the style of vLLM's unit test.

vLLM's ``tests/v1/worker/test_kv_block_zeroer.py`` (added by #48085) has one
race test: stall the stream with ``torch.cuda._sleep(10_000_000)`` so the first non-blocking
copy stays pending, call ``zero_block_ids([1])`` and ``zero_block_ids([2])`` back to back,
synchronise, and check that rows 1 and 2 are zero and rows 0 and 3 untouched. This baseline is
that test played through :class:`~fuzz.engine.episode.Episode`, with recycled blocks so the stale bytes
are the NaN poison of a page's previous tenant:

1. take every free block (so freed ones come straight back from the FIFO free queue), write
   the first two as a request's KV, synchronise, free both (poisoned);
2. stall stream 0 (``delay`` 50 units = ``torch.cuda._sleep(10_000_000)`` on cuda);
3. reallocate them one call at a time, back to back: ``zero_block_ids([a])``, then
   ``zero_block_ids([b])`` before the first copy ran;
4. read both on stream 1 (the caller waits for each zero, promise b), synchronise.

It runs once, deterministically (on cuda in free mode), and reports value findings only, like
the stress loop: the end-of-episode check also covers the untouched blocks (vLLM's rows 0 and 3).
As in vLLM's test, two outstanding calls are what it checks, so a ring of depth 2 passes it.

Example::

    outcome = handwritten(EpisodeConfig(zeroer="single_buffer", kernel="torch"), 1.0, 0)
    outcome.found     # True: block 1 still holds the poison
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from fuzz.bench.detect.baselines.stress import (
    DEFAULT_REPRO_DIR,
    NEEDS_CUDA,
    NO_FINDING,
    check_budget,
    check_seed,
    one_line,
    resolve_config,
    value_findings,
)
from fuzz.bench.detect.outcome import DetectionOutcome
from fuzz.engine.episode import Episode, EpisodeConfig
from fuzz.engine.trace import write_trace

# vLLM's test stalls with torch.cuda._sleep(10_000_000); a delay unit is 200_000 cycles on cuda
# (kvdevice.runtime.cuda.DELAY_CYCLES_PER_UNIT), so 50 units is the same stall.
VLLM_STALL_UNITS = 50


def play(episode: Episode) -> None:
    """Apply the hand-written interleaving to a fresh ``episode`` (it needs two free blocks)."""
    apply = episode.apply
    apply({"op": "start", "in_flight": 1})
    taken = apply({"op": "allocate", "n": len(episode.free), "stream": 0})
    first, second = taken[0], taken[1]
    apply({"op": "write", "block": first, "stream": 0})
    apply({"op": "write", "block": second, "stream": 0})
    apply({"op": "sync_device"})
    apply({"op": "free", "block": first})  # poisoned, and next in the free queue
    apply({"op": "free", "block": second})
    apply({"op": "delay", "stream": 0, "amount": VLLM_STALL_UNITS})
    a = apply({"op": "allocate", "n": 1, "stream": 0})
    b = apply({"op": "allocate", "n": 1, "stream": 0})
    apply({"op": "read", "block": a[0], "stream": 1 % len(episode.streams)})
    apply({"op": "read", "block": b[0], "stream": 1 % len(episode.streams)})
    apply({"op": "sync_device"})


def handwritten(
    config: EpisodeConfig, budget_s: float, seed: int, *, repro_dir: Path | None = None
) -> DetectionOutcome:
    """Baseline (d): run :func:`play` once; ``budget_s`` and ``seed`` are checked but unused."""
    check_budget(budget_s)
    check_seed(seed)
    config = resolve_config(config)
    if config.backend == "cuda" and not torch.cuda.is_available():
        return NEEDS_CUDA
    start = time.perf_counter()
    episode = Episode(config)
    try:
        play(episode)
        findings = value_findings(episode.finish())
    except Exception as exc:
        return DetectionOutcome(
            False, None, 1, episode.step, None, None, NO_FINDING,
            error=one_line(f"the hand-written sequence raised {type(exc).__name__} at op {episode.step}: {exc}"),
        )
    finally:
        if not episode.finished:  # stopped by an error or Ctrl-C: its zeroer and runtime still closed
            episode.abandon()
    seconds = time.perf_counter() - start
    if not findings:
        return DetectionOutcome(False, None, 1, episode.step, None, None, NO_FINDING)
    path = write_trace(repro_dir or DEFAULT_REPRO_DIR, config, list(episode.trace), findings, campaign="baseline-handwritten")
    return DetectionOutcome(True, seconds, 1, episode.step, episode.step, str(path), one_line(str(findings[0])))
