"""The Hypothesis state machine: interleavings of allocate, write, zero, read, free and device
progress across several streams, judged by the oracle.

Rules are domain verbs and every choice, including which stream runs next and by how much, is a
rule argument, so a shrunk failure prints as a short program you can read::

    state = single_buffer_on_tiny()
    state.start(in_flight=1)
    blocks_0 = state.allocate_blocks(n=1, stream=0)
    blocks_1 = state.allocate_blocks(n=1, stream=0)
    state.read_block(block=blocks_0, stream=1)
    state.teardown()

Each rule turns into one op record executed by :class:`~fuzz.engine.episode.Episode`, so the fuzzer and
the replayer share one definition of every op.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    multiple,
    precondition,
    rule,
)

from fuzz.engine.episode import CachePool, Episode, EpisodeConfig
from fuzz.engine.journal import Journal
from fuzz.engine.oracle import Finding


# Every simulator campaign's examples share one pool of KV caches (fuzz.engine.episode.CachePool says
# why that is safe); building a fresh cache was the largest part of starting an example.
_CACHES = CachePool()


class ZeroerViolation(AssertionError):
    """The oracle's verdict on one episode: a list of findings, phrased for a person."""

    def __init__(self, findings: list[Finding], trace: list[dict], config: EpisodeConfig) -> None:
        self.findings = findings
        self.trace = trace
        self.config = config
        head = f"{len(findings)} finding(s) for zeroer {config.zeroer!r} on {config.geometry} ({config.backend})"
        super().__init__("\n".join([head] + [f"  - {f}" for f in findings[:10]]))


@dataclass(frozen=True)
class BlockRef:
    """A live block as the program holds it (printed as ``blocks_N`` in a shrunk program)."""

    block: int
    owner: int

    def __repr__(self) -> str:
        return f"BlockRef(block={self.block})"


class ZeroerMachine(RuleBasedStateMachine):
    """Subclassed per campaign by :func:`machine_for`, which sets ``config``."""

    config: EpisodeConfig = EpisodeConfig()
    blocks = Bundle("blocks")
    #: the last episode that raised, so a campaign can save its (shrunk) trace
    last_failure: ZeroerViolation | None = None
    #: where each op is saved before it runs (cuda: a fault kills the worker), or None
    journal: Journal | None = None

    def __init__(self) -> None:
        super().__init__()
        self.episode = Episode(self.config, caches=_CACHES)
        self._may_reallocate = self.episode.loaded.capabilities.follows_reallocation

    def _apply(self, **op):
        if self.journal is not None:
            self.journal.record(self.config, [*self.episode.trace, op])
        result = self.episode.apply(op)
        # Happens-before hazards are checked after every op, so a shrunk program stops at the
        # op that raised the first one. Here rather than in an @invariant: Hypothesis's per-step
        # invariant machinery cost 5 to 7% of a campaign's time, and every step is an op.
        self._raise_if(self.episode.new_hazard_findings())
        return result

    def _raise_if(self, findings: list[Finding]) -> None:
        if findings:
            error = ZeroerViolation(list(self.episode.findings), list(self.episode.trace), self.config)
            type(self).last_failure = error
            self.episode.close()
            raise error

    @initialize(in_flight=st.integers(1, 3))
    def start(self, in_flight: int) -> None:
        self._apply(op="start", in_flight=in_flight)

    # Small calls (a decode step's new block) and larger ones (a prefill's): graph_ring stages a
    # call in a graph sized to the next power of two, so a 5-id call after a 7-id one on the same
    # slot is what shows stale padding (tests/graph_ring_mutants.py SkipsPadding); 1..3 alone
    # never reaches a slot's 4th id. Shrinking prefers the small branch.
    @precondition(lambda self: len(self.episode.free) > 0)
    @rule(target=blocks, n=st.integers(1, 3) | st.integers(4, 8), stream=st.integers(0, 2))
    def allocate_blocks(self, n: int, stream: int):
        n = min(n, len(self.episode.free))
        ids = self._apply(op="allocate", n=n, stream=stream % len(self.episode.streams))
        return multiple(*(BlockRef(b, self.episode._owners) for b in ids))

    @rule(block=blocks, stream=st.integers(0, 2))
    def write_block(self, block: BlockRef, stream: int) -> None:
        self._apply(op="write", block=block.block, stream=stream % len(self.episode.streams))

    @rule(block=blocks, stream=st.integers(0, 2))
    def read_block(self, block: BlockRef, stream: int) -> None:
        self._apply(op="read", block=block.block, stream=stream % len(self.episode.streams))

    @rule(block=consumes(blocks))
    def free_block(self, block: BlockRef) -> None:
        self._apply(op="free", block=block.block)

    @rule(stream=st.integers(0, 2), ops=st.integers(1, 4))
    def advance_stream(self, stream: int, ops: int) -> None:
        self._apply(op="advance", stream=stream % len(self.episode.streams), ops=ops)

    @rule(stream=st.integers(0, 2), amount=st.integers(1, 8))
    def delay_stream(self, stream: int, amount: int) -> None:
        self._apply(op="delay", stream=stream % len(self.episode.streams), amount=amount)

    @rule()
    def end_step(self) -> None:
        self._apply(op="end_step")

    @rule(stream=st.integers(0, 2))
    def synchronize_stream(self, stream: int) -> None:
        self._apply(op="sync_stream", stream=stream % len(self.episode.streams))

    @rule()
    def synchronize_device(self) -> None:
        self._apply(op="sync_device")

    # Once per example: a reallocation drains the device, so more would only hide races. (The
    # precondition runs before every step: it reads one flag set in __init__.)
    @precondition(lambda self: self._may_reallocate)
    @rule()
    def reallocate_cache(self) -> None:
        self._may_reallocate = False
        self._apply(op="reallocate")

    def teardown(self) -> None:
        if not self.episode.finished:
            self._raise_if(self.episode.finish())


def machine_for(config: EpisodeConfig, name: str | None = None, journal: Journal | None = None) -> type[ZeroerMachine]:
    """A state machine class bound to ``config`` (named so a shrunk program says what it ran)."""
    label = name or f"{config.zeroer}_on_{config.geometry}".replace(":", "_").replace("/", "_").replace(".", "_")
    return type(label, (ZeroerMachine,), {"config": config, "last_failure": None, "journal": journal})
