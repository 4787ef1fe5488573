"""A finding as it leaves an episode: the oracle's verdict, with the program that earned it.

Model. An episode the oracle judges wrong ends in one :class:`ZeroerViolation`: the findings
(:class:`~fuzz.engine.oracle.Finding`, phrased for a person), the ops that led to them (the
program a trace file saves and a replay runs again) and the episode's config. It is an
``AssertionError`` because that is what it is to Hypothesis: a failing example, to be shrunk. It
is a value too: the state machine raises it (:mod:`fuzz.engine.machine`), the shrinkers take it
in and hand a smaller one back (:mod:`fuzz.engine.shrink`, :mod:`fuzz.engine.minimize`), the
run's registry names its bug (:mod:`fuzz.engine.signature`, :mod:`fuzz.engine.known_bugs`) and
the campaign saves it (:mod:`fuzz.engine.campaigns`).

It lives apart from the state machine so that those readers need not import the machine (and
Hypothesis with it), and so that the machine can import the registry without a circle. Standard
library only at run time: signatures are read without torch.

Example::

    violation = ZeroerViolation([finding], episode.trace, config)
    str(violation).splitlines()[0]   # "1 finding(s) for zeroer 'ring' on tiny (sim)"
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: both modules import torch
    from fuzz.engine.episode import EpisodeConfig
    from fuzz.engine.oracle import Finding


class ZeroerViolation(AssertionError):
    """The oracle's verdict on one episode: a list of findings, phrased for a person."""

    def __init__(self, findings: list[Finding], trace: list[dict], config: EpisodeConfig) -> None:
        self.findings = findings
        self.trace = trace
        self.config = config
        offloader = getattr(config, "offloader", None)
        under_test = f"offloader {offloader!r}" if offloader else f"zeroer {config.zeroer!r}"
        head = f"{len(findings)} finding(s) for {under_test} on {config.geometry} ({config.backend})"
        super().__init__("\n".join([head] + [f"  - {f}" for f in findings[:10]]))
