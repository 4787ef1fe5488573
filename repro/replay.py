"""Replaying ops through the fuzzer's executor, once or N times.

The replayer is :class:`fuzz.engine.episode.Episode` itself, so an op means here exactly what it meant
when the fuzzer ran it. Like the fuzzer, a replay stops at the first happens-before
hazard, then synchronises once and lets the oracle check every read and every block.

Example::

    findings = replay_once(EpisodeConfig(zeroer="single_buffer"), ops)
    shown, first = replay(config, ops, repeat=20)    # on cuda: how often it reproduced
"""

from __future__ import annotations

from fuzz.engine.episode import EpisodeConfig, run_ops
from fuzz.engine.oracle import Finding


def replay_once(config: EpisodeConfig, ops: list[dict]) -> list[Finding]:
    return run_ops(config, ops)


def replay(config: EpisodeConfig, ops: list[dict], repeat: int = 1) -> tuple[int, list[Finding]]:
    """Run the ops ``repeat`` times: (how many runs showed a finding, the first run's findings)."""
    shown, first = 0, []
    for _ in range(repeat):
        findings = replay_once(config, ops)
        if findings:
            shown += 1
            first = first or findings
    return shown, first
