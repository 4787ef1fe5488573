"""Replaying ops through the fuzzer's executor, once or N times.

The replayer is :class:`fuzz.engine.episode.Episode` itself, so an op means here exactly what it meant
when the fuzzer ran it. Like the fuzzer, a replay stops at the first happens-before
hazard, then synchronises once and lets the oracle check every read and every block.

Example::

    findings = replay_once(EpisodeConfig(zeroer="single_buffer"), ops)
    shown, first, other = replay(config, ops, repeat=20)    # on cuda: how often it reproduced
"""

from __future__ import annotations

from fuzz.engine.episode import EpisodeConfig, run_ops
from fuzz.engine.oracle import Finding


def replay_once(config: EpisodeConfig, ops: list[dict]) -> list[Finding]:
    return run_ops(config, ops)


def replay(config: EpisodeConfig, ops: list[dict], repeat: int = 1,
           kinds: frozenset[str] | None = None) -> tuple[int, list[Finding], int]:
    """Run the ops ``repeat`` times: (how many runs reproduced, the first such run's findings, how
    many runs showed only other findings). With ``kinds`` (the kinds the trace recorded), a run
    reproduces when it shows one of those kinds: a zeroer that raised where the trace recorded a
    race (or the reverse) is a different finding, not the bug shown again."""
    shown, first, other = 0, [], 0
    for _ in range(repeat):
        findings = replay_once(config, ops)
        if not findings:
            continue
        if kinds and not kinds & {f.kind for f in findings}:
            other += 1
            first = first or findings
            continue
        shown += 1
        first = first or findings
    return shown, first, other
