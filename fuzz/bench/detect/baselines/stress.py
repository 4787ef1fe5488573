"""Baseline (b): a plain random stress loop over the fuzzer's ops, judged by the value oracle only.

What an engine developer would write before reaching for a fuzzer: build an episode, throw
random ``allocate`` / ``write`` / ``read`` / ``free`` / ``end_step`` / ``sync_stream`` /
``sync_device`` ops at it, check the values at the end, repeat until the time is up. It goes
through the same :class:`~fuzz.engine.episode.Episode` executor and the same oracle as the fuzzer, but

* draws ops from one ``random.Random(seed)``, not Hypothesis (nothing shrinks);
* never chooses ``advance`` or ``delay``: it cannot steer the device, so on cuda it runs in
  free mode and real timing decides, and on the simulator the lazy schedule decides (the device
  runs only at ``end_step`` past ``in_flight``, at host syncs and at the end of an episode);
* reports **value findings only** (``non-zero after zeroing``, ``clobbered``, ``stray write``).
  The happens-before checker is part of this project's runtime, not something a user's stress
  loop has, so its ``hazard`` findings are counted but never reported as a detection.

Example::

    outcome = stress(EpisodeConfig(zeroer="single_buffer", kernel="torch"), budget_s=5.0, seed=1)
    outcome.found, outcome.message     # True, 'non-zero after zeroing: block 1, ...'
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from fuzz.bench import BenchUsageError
from fuzz.bench.detect.outcome import DetectionOutcome
from racecheck.cli import one_line  # noqa: F401 - one_line: re-exported to the other baselines
from fuzz.engine.episode import CodeUnderTestRaised, Episode, EpisodeConfig
from fuzz.engine.oracle import Finding
from fuzz.engine.trace import write_trace

STEPS_PER_EPISODE = 25  # the fuzzer's step count per example (quick and ci profiles)
# Blocks per allocate, as the fuzzer's allocate_blocks rule draws them: 1..3 or 4..8, each half
# the time, capped at the free count.
SMALL_ALLOCATE, MAX_ALLOCATE = 3, 8
MAX_IN_FLIGHT = 3  # as the fuzzer's start rule draws it
DEFAULT_REPRO_DIR = Path("repro/failures/baselines")
NO_FINDING = "no finding"
# What a method reports where it needs a GPU and there is none (a frozen record: one serves every run).
NEEDS_CUDA = DetectionOutcome(False, None, None, 0, None, None, NO_FINDING, error="needs CUDA")
# The fuzzer's ops minus the two that steer the device ("advance", "delay") and "start".
STRESS_OPS = ("allocate", "end_step", "free", "read", "sync_device", "sync_stream", "write")


def check_budget(budget_s: object) -> float:
    """``budget_s`` as a float, or a :class:`BenchUsageError` that names the value."""
    if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or not budget_s > 0 or not math.isfinite(budget_s):
        raise BenchUsageError(f"budget_s={budget_s!r} must be a positive, finite number of seconds (e.g. 10)")
    return float(budget_s)


def check_seed(seed: object) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise BenchUsageError(f"seed={seed!r} must be an int (e.g. 0)")
    return seed


def resolve_config(config: EpisodeConfig) -> EpisodeConfig:
    """``auto`` resolved to a backend; on cuda the free-running mode (real timing decides)."""
    if config.backend == "auto":
        config = replace(config, backend="cuda" if torch.cuda.is_available() else "sim")
    if config.backend == "cuda":
        config = replace(config, mode="free")
    return config


def value_findings(findings: list[Finding]) -> list[Finding]:
    """What a user's own check would see: wrong values, not the happens-before checker's hazards."""
    return [f for f in findings if f.kind != "hazard"]


class EpisodeHooks:
    """Where a variant of the loop (the sanitizer child) adjusts an episode; no-ops here."""

    def created(self, episode: Episode) -> None:
        """Called once the episode is built, before its ``start`` op."""

    def apply(self, episode: Episode, op: dict) -> Any:
        return episode.apply(op)

    def finishing(self, episode: Episode) -> None:
        """Called right before ``episode.finish()``."""


def draw_op(rng: random.Random, episode: Episode, live: list[int]) -> dict:
    """One random op that is valid now, chosen uniformly among the ops that are enabled. An offload
    episode's loop also stores, loads, evicts and polls, keeping the caller's promises: a block under
    a job is not written or freed (nor read while it loads) until the job is reported finished."""
    enabled = ["end_step", "sync_device", "sync_stream"]
    if episode.free:
        enabled.append("allocate")
    offload = episode.component
    writable, readable = live, live
    if offload is not None:
        shadow = episode.shadow.blocks
        writable = [b for b in live if b not in offload.busy and shadow[b].state == "live"]
        readable = [b for b in live if shadow[b].state == "live"]
        stored = [i for i, slot in enumerate(offload.slots) if slot.state == "stored"]
        evictable = [i for i in stored if not offload.slots[i].loads]
        enabled.append("poll")
        if writable and offload.free_slots:
            enabled.append("store")
        if stored and episode.free:
            enabled.append("load")
        if evictable:
            enabled.append("evict")
    if writable:
        enabled += ["free", "write"]
    if readable:
        enabled.append("read")
    name = rng.choice(sorted(enabled))
    streams = len(episode.streams)
    if name == "store":
        return {"op": name, "block": rng.choice(writable), "stream": rng.randrange(streams)}
    if name == "load":
        return {"op": name, "slot": rng.choice(stored), "stream": rng.randrange(streams), "oldest": rng.randrange(2)}
    if name == "evict":
        return {"op": name, "slot": rng.choice(evictable)}
    if name == "poll":
        return {"op": name, "sync": rng.randrange(2)}
    if name in ("read", "write"):
        return {"op": name, "block": rng.choice(readable if name == "read" else writable), "stream": rng.randrange(streams)}
    if name == "free":
        return {"op": name, "block": rng.choice(writable)}
    if name == "allocate":
        n = rng.randint(1, SMALL_ALLOCATE) if rng.random() < 0.5 else rng.randint(SMALL_ALLOCATE + 1, MAX_ALLOCATE)
        return {"op": name, "n": min(n, len(episode.free)), "stream": rng.randrange(streams)}
    if name == "sync_stream":
        return {"op": name, "stream": rng.randrange(streams)}
    return {"op": name}


@dataclass
class StressResult:
    """What one run of the loop did; ``first`` is its first value finding, if any."""

    config: EpisodeConfig
    episodes: int = 0
    steps: int = 0
    hazards: int = 0  # happens-before findings seen (never reported as a detection)
    seconds: float = 0.0
    first: Finding | None = None
    first_findings: list[Finding] = field(default_factory=list)
    first_s: float | None = None
    first_episodes: int | None = None
    first_trace: list[dict] | None = None
    exception: BaseException | None = None  # what stopped the loop, if an op raised
    exception_trace: list[dict] | None = None  # the ops of that episode, the raising one last
    exception_s: float | None = None


def stress_loop(
    config: EpisodeConfig,
    budget_s: float,
    seed: int,
    *,
    stop_on_finding: bool = True,
    hooks: EpisodeHooks | None = None,
) -> StressResult:
    """Random episodes until a value finding (if ``stop_on_finding``), an exception, or the budget."""
    hooks = hooks or EpisodeHooks()
    rng = random.Random(seed)
    result = StressResult(config)
    start = time.perf_counter()
    while time.perf_counter() - start < budget_s:
        episode: Episode | None = None
        try:
            episode = Episode(config)
            result.episodes += 1
            hooks.created(episode)
            result.steps += 1
            hooks.apply(episode, {"op": "start", "in_flight": rng.randint(1, MAX_IN_FLIGHT)})
            live: list[int] = []
            for _ in range(STEPS_PER_EPISODE):
                op = draw_op(rng, episode, live)
                result.steps += 1
                outcome = hooks.apply(episode, op)
                if op["op"] == "allocate":
                    live.extend(outcome)
                elif op["op"] == "load":
                    live.append(outcome)
                elif op["op"] == "free":
                    live.remove(op["block"])
                episode.new_hazard_findings()  # as the fuzzer does after every op; counted, not reported
            hooks.finishing(episode)
            findings = value_findings(episode.finish())
            result.hazards += sum(f.kind == "hazard" for f in episode.findings)
        except Exception as exc:  # a zeroer that raised, CSAN's report in the sanitizer child, ...
            result.exception, result.exception_s = exc, time.perf_counter() - start
            result.exception_trace = list(episode.trace) if episode is not None else []
            break
        finally:
            if episode is not None and not episode.finished:  # an error or Ctrl-C: its zeroer and runtime still closed
                episode.abandon()
        if findings and result.first is None:
            result.first, result.first_findings = findings[0], findings
            result.first_s, result.first_episodes = time.perf_counter() - start, result.episodes
            result.first_trace = list(episode.trace)
            if stop_on_finding:
                break
    result.seconds = time.perf_counter() - start
    return result


def stress(
    config: EpisodeConfig, budget_s: float, seed: int, *, repro_dir: Path | None = None
) -> DetectionOutcome:
    """Baseline (b): the plain stress loop; stops at its first value finding or after ``budget_s``.

    On a finding its episode's ops are written as a trace (``python -m repro replay`` runs it)
    under ``repro_dir`` (default ``repro/failures/baselines``).
    """
    budget_s, seed = check_budget(budget_s), check_seed(seed)
    config = resolve_config(config)
    if config.backend == "cuda" and not torch.cuda.is_available():
        return NEEDS_CUDA
    result = stress_loop(config, budget_s, seed)
    if isinstance(result.exception, CodeUnderTestRaised):
        # The code under test's own call failed (it raised, or CUDA refused it: a handler that times
        # a job it has not seen finish): a user's loop fails there too, so the bug showed.
        result.first, result.first_findings = result.exception.finding, [result.exception.finding]
        result.first_s, result.first_episodes = result.exception_s, result.episodes
        result.first_trace = result.exception_trace
    elif result.exception is not None:
        return DetectionOutcome(
            False, None, result.episodes, result.steps, None, None, NO_FINDING,
            error=one_line(f"episode {result.episodes} raised {type(result.exception).__name__}: {result.exception}"),
        )
    if result.first is None:
        return DetectionOutcome(False, None, result.episodes, result.steps, None, None, NO_FINDING)
    path = write_trace(
        repro_dir or DEFAULT_REPRO_DIR, config, result.first_trace, result.first_findings,
        seed=seed, campaign=f"baseline-stress-seed{seed}",
    )
    return DetectionOutcome(
        True, result.first_s, result.first_episodes, result.steps, len(result.first_trace), str(path),
        one_line(str(result.first)),
    )
