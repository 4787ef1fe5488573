"""The Hypothesis state machine: interleavings of allocate, write, zero, read, free and device
progress across several streams and caches, judged by the oracle.

Rules are domain verbs and every choice, including which stream runs next and by how much, is a
rule argument, so a shrunk failure prints as a short program you can read::

    state = single_buffer_tiny_sim_shard0()
    state.start(in_flight=1, disabled=frozenset())
    blocks_0 = state.allocate_blocks(n=1, stream=0)
    blocks_1 = state.allocate_blocks(n=1, stream=0)
    state.teardown()

Each rule turns into one op record executed by :class:`~fuzz.engine.episode.Episode`, so the
fuzzer and the replayer share one definition of every op.

Depth. The races this tool hunts need the host far ahead of the device: several zero calls still
queued when a staging slot comes round again. Two things make such programs common without
making simple ones rare:

* **swarm testing**: each example starts by drawing a set of optional rules to leave out
  (``disabled``), so some examples never advance the device or synchronise and the host runs
  ahead, while others interleave everything; shrinking prefers leaving nothing out;
* **targeting**: each example reports the most device ops it had queued
  (``hypothesis.target``), and Hypothesis's target phase steers towards deeper queues.

What an example did is counted into the campaign's :class:`CampaignStats`, which the machine class
is given (:func:`machine_for`), and a finding leaves as the
:class:`~fuzz.engine.violation.ZeroerViolation` it raises, or, when another campaign of the run
has already shrunk the same bug, as :class:`~fuzz.engine.known_bugs.SameBug`, which Hypothesis
does not shrink.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from hypothesis import target
from hypothesis.control import current_build_context, currently_in_test_context
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, multiple, precondition, rule

from fuzz.engine.cache_pool import CachePool
from fuzz.engine.component import COMPONENT_KINDS, chosen_kinds, load
from fuzz.engine.episode import CodeUnderTestRaised, Episode, EpisodeConfig
from fuzz.engine.harness_error import harness_error
from fuzz.engine.journal import Journal
from fuzz.engine.known_bugs import KnownBugs
from fuzz.engine.ops import IDS_AS, THEN
from fuzz.engine.oracle import Finding
from racecheck.resources import raise_if_resource
from fuzz.engine.violation import ZeroerViolation
from racecheck.interrupts import interrupted

# Every simulator campaign's examples share one pool of KV caches (fuzz.engine.cache_pool says
# why that is safe); building a fresh cache was the largest part of starting an example.
_CACHES = CachePool()

# Rules an example may leave out (swarm testing); allocating and freeing always stay.
OPTIONAL_RULES = ("advance_stream", "delay_stream", "end_step", "read_block", "synchronize_device",
                  "synchronize_stream", "write_block")
BLOCKS = Bundle("blocks")  # the live blocks a program holds, shared by every part of the machine


class BudgetSpent(KeyboardInterrupt):
    """A campaign's time budget ran out with nothing found. Not a failure (Hypothesis would shrink
    an Exception): Hypothesis lets an interruption through at once, checking nothing, and
    :func:`~fuzz.engine.campaigns.run_campaign` reports the campaign clean."""


def _final_replay() -> bool:
    """Whether Hypothesis is replaying the failing example it is about to report."""
    return currently_in_test_context() and current_build_context().is_final


class ShrinkBoundReached(KeyboardInterrupt):
    """Hypothesis has shrunk a finding for as long as the campaign's shrink bound allows
    (:data:`fuzz.engine.shrink.SHRINK_BOUND_S`). Raised instead of starting the next example, it
    passes through Hypothesis at once, as :class:`BudgetSpent` does, and
    :func:`~fuzz.engine.campaigns.run_campaign` reports the smallest program so far
    (:attr:`CampaignStats.smallest`) as the finding, marked cut off. A real Ctrl-C is a plain
    KeyboardInterrupt (and :func:`~racecheck.interrupts.interrupted` is set), never this class."""


@dataclass
class CampaignStats:
    """What a campaign's examples did, counted as they run."""

    started: float  # time.monotonic() at the start of the run
    deadline: float | None = None  # time.monotonic() past which no new example starts
    examples: int = 0
    steps: int = 0
    first_finding_s: float | None = None
    first_finding_examples: int | None = None
    deepest_queue: int = 0  # most device ops queued at once, over all examples
    # The shortest program that showed a finding so far: what run_campaign saves if Ctrl-C cuts
    # the run off while Hypothesis is still shrinking it.
    smallest: ZeroerViolation | None = None
    # Seconds Hypothesis may go on after the first finding (shrinking it); 0: it stops at the next
    # example, where it does not shrink; None: no bound.
    shrink_bound_s: float | None = None

    def shrink_overdue(self) -> bool:
        """A finding was made and Hypothesis has gone on for longer than the bound."""
        if self.shrink_bound_s is None or self.first_finding_s is None:
            return False
        return time.monotonic() - self.started > self.first_finding_s + self.shrink_bound_s

    def found(self, violation: ZeroerViolation) -> None:
        if self.first_finding_s is None:
            self.first_finding_s = time.monotonic() - self.started
            self.first_finding_examples = self.examples
        if self.smallest is None or len(violation.trace) <= len(self.smallest.trace):
            self.smallest = violation


@dataclass(frozen=True)
class BlockRef:
    """A live block as the program holds it (printed as ``blocks_N`` in a shrunk program)."""

    block: int
    cache: int
    owner: int = field(repr=False)


class CallerMachine(RuleBasedStateMachine):
    """The caller's rules (allocate, write, read, free, device progress, reallocation), whatever the
    code under test: a campaign's machine is this and one component's part (:class:`ZeroerPart`,
    :class:`OffloadPart`), subclassed per campaign by :func:`machine_for`, which sets the class
    attributes below."""

    config: EpisodeConfig = EpisodeConfig()
    stats: CampaignStats | None = None
    #: where each op is saved before it runs (cuda: a fault kills the worker), or None
    journal: Journal | None = None
    #: the run's bugs shrunk by other campaigns: a failing example of one of them stops the campaign
    known_bugs: KnownBugs | None = None
    blocks = BLOCKS

    def __init__(self) -> None:
        stats = self.stats
        if stats is not None and stats.deadline is not None and stats.first_finding_s is None \
                and time.monotonic() > stats.deadline:
            raise BudgetSpent()
        if interrupted():
            raise KeyboardInterrupt("the run was interrupted")
        # Checked after Ctrl-C, which wins. Hypothesis's final replay of the finding it reports is let
        # through: stopped there, Hypothesis calls the run inconsistent (FlakyStrategyDefinition).
        if stats is not None and stats.shrink_overdue() and not _final_replay():
            raise ShrinkBoundReached()
        super().__init__()
        if stats is not None:
            stats.examples += 1
        self.disabled: frozenset[str] = frozenset()
        self.episode: Episode | None = None
        self._may_reallocate = False
        self._deepest = 0
        try:  # a factory that raises is a usage error (HarnessError), never a finding: Hypothesis lets it through
            self.episode = Episode(self.config, caches=_CACHES)
        except Exception as error:  # the harness building caches may run the GPU out of memory
            raise_if_resource(error, "building the episode's caches")
            raise harness_error(error, "building the episode") from error
        # An offloader keeps the cache's tensors it was built with, as an engine's handler does.
        component = self.episode.component
        self._may_reallocate = self.episode.loaded.capabilities.follows_reallocation and not (
            component is not None and component.keeps_cache_tensors)

    # -- plumbing ----------------------------------------------------------------------------
    def _apply(self, **op):
        episode = self.episode
        if self.journal is not None:
            self.journal.record(self.config, [*episode.trace, op])
        if self.stats is not None:
            self.stats.steps += 1
        try:
            result = episode.apply(op)
        except CodeUnderTestRaised as error:
            self._fail(list(episode.findings), list(episode.trace))
            raise AssertionError("unreachable") from error  # _fail raised
        except Exception as error:  # the zeroer's own calls are judged in the episode: this is the harness's
            raise_if_resource(error, f"in op {op.get('op')!r}")
            raise harness_error(error, f"op {op.get('op')!r}", step=len(episode.trace)) from error
        # Happens-before hazards are checked after every op, so a shrunk program stops at the op
        # that raised the first one (here rather than in an @invariant: that machinery cost 5 to
        # 7% of a campaign's time, and every step is an op).
        findings = episode.new_hazard_findings()
        if findings:
            self._fail(list(episode.findings), list(episode.trace))
        self._deepest = max(self._deepest, episode.queued())
        return result

    def _fail(self, findings: list[Finding], trace: list[dict]) -> None:
        if self.episode is not None:
            self.episode.abandon()
        if interrupted():  # a verdict reached after Ctrl-C is not trusted (racecheck.interrupts)
            raise KeyboardInterrupt("the run was interrupted")
        violation = ZeroerViolation(findings, trace, self.config)
        if self.stats is not None:
            self.stats.found(violation)
        if self.known_bugs is not None:  # shrunk by another campaign of the run: stop here (SameBug)
            self.known_bugs.check(violation)
        raise violation

    def _n_streams(self, stream: int) -> int:
        return stream % len(self.episode.streams)

    def _enabled(self, rule_name: str) -> bool:
        return rule_name not in self.disabled

    # -- rules -------------------------------------------------------------------------------
    # Small calls (a decode step's new block) and larger ones (a prefill's): graph_ring stages a
    # call in a graph sized to the next power of two, so a 5-id call after a 7-id one on the same
    # slot is what shows stale padding (tests/graph_ring_mutants.py SkipsPadding); 1..3 alone
    # never reaches a slot's 4th id. Shrinking prefers the small branch, a list the caller keeps,
    # and the first cache.
    @precondition(lambda self: bool(self.episode.groups[0].free))
    @rule(target=blocks, n=st.integers(1, 3) | st.integers(4, 8), stream=st.integers(0, 2))
    def allocate_blocks(self, n: int, stream: int):
        return self._allocate(0, n, stream, "list", "keep")

    def _allocate(self, cache: int, n: int, stream: int, ids_as: str, then: str):
        groups = self.episode.groups
        group = groups[cache % len(groups)]
        if not group.free:  # this cache is full: take the first one with room
            group = next(g for g in groups if g.free)
        n = min(n, len(group.free))
        accepted = group.zeroer.ids_as
        if ids_as not in accepted:  # the caller keeps to the zeroer's contract (zeroer.id_containers)
            ids_as = "list" if "list" in accepted else accepted[0]
        op = {"op": "allocate", "n": n, "stream": self._n_streams(stream)}
        if group.index:
            op["cache"] = group.index
        if ids_as != "list":
            op["ids_as"] = ids_as
        if then != "keep":
            op["then"] = then
        ids = self._apply(**op)
        return multiple(*(BlockRef(b, group.index, self.episode.owners) for b in ids))

    def _usable(self, block: BlockRef, *, reading: bool = False) -> bool:
        """Whether the caller may touch ``block`` now (a component's part may keep some from it)."""
        return True

    @precondition(lambda self: self._enabled("write_block"))
    @rule(block=blocks, stream=st.integers(0, 2))
    def write_block(self, block: BlockRef, stream: int) -> None:
        if self._usable(block):
            self._apply(op="write", block=block.block, stream=self._n_streams(stream), **_cache_field(block))

    @precondition(lambda self: self._enabled("read_block"))
    @rule(block=blocks, stream=st.integers(0, 2))
    def read_block(self, block: BlockRef, stream: int) -> None:
        if self._usable(block, reading=True):
            self._apply(op="read", block=block.block, stream=self._n_streams(stream), **_cache_field(block))

    @rule(block=consumes(blocks))
    def free_block(self, block: BlockRef) -> None:
        if self._usable(block):  # a block under a job stays allocated (and out of the bundle)
            self._apply(op="free", block=block.block, **_cache_field(block))

    @precondition(lambda self: self._enabled("advance_stream"))
    @rule(stream=st.integers(0, 2), ops=st.integers(1, 4))
    def advance_stream(self, stream: int, ops: int) -> None:
        self._apply(op="advance", stream=self._n_streams(stream), ops=ops)

    @precondition(lambda self: self._enabled("delay_stream"))
    @rule(stream=st.integers(0, 2), amount=st.integers(1, 8))
    def delay_stream(self, stream: int, amount: int) -> None:
        self._apply(op="delay", stream=self._n_streams(stream), amount=amount)

    @precondition(lambda self: self._enabled("end_step"))
    @rule()
    def end_step(self) -> None:
        self._apply(op="end_step")

    @precondition(lambda self: self._enabled("synchronize_stream"))
    @rule(stream=st.integers(0, 2))
    def synchronize_stream(self, stream: int) -> None:
        self._apply(op="sync_stream", stream=self._n_streams(stream))

    @precondition(lambda self: self._enabled("synchronize_device"))
    @rule()
    def synchronize_device(self) -> None:
        self._apply(op="sync_device")

    # Once per example: a reallocation drains the device, so more would only hide races. (The
    # precondition runs before every step: it reads one flag set in __init__.)
    @precondition(lambda self: self._may_reallocate)
    @rule(cache=st.integers(0, 3))
    def reallocate_cache(self, cache: int) -> None:
        self._may_reallocate = False
        index = cache % len(self.episode.groups)
        self._apply(op="reallocate", **({"cache": index} if index else {}))

    def _target_component(self) -> None:
        """A component's part may steer Hypothesis's target phase too (called first in teardown)."""

    def teardown(self) -> None:
        self._target_component()
        episode = self.episode
        if episode is None or episode.finished:
            return
        if episode.in_op or interrupted():
            # Cut off mid-op (Ctrl-C, a signal, an error in the harness): the episode is not a
            # program that ran to its end, so it is not judged, and nothing is reported for it.
            episode.abandon()
            return
        if currently_in_test_context():  # the machine may also be driven by hand (tests)
            target(float(self._deepest), label="device ops queued at once")
        if self.stats is not None and self._deepest > self.stats.deepest_queue:
            self.stats.deepest_queue = self._deepest
        try:
            findings = episode.finish()
        except CodeUnderTestRaised:
            findings = list(episode.findings)
        except BaseException as error:  # Ctrl-C while judging, or an error of the harness: no verdict
            episode.abandon()
            if isinstance(error, Exception):  # the oracle's reads may run the GPU out of memory
                raise_if_resource(error, "judging the episode")
                raise harness_error(error, "judging the episode", step=len(episode.trace)) from error
            raise
        if findings:
            self._fail(findings, list(episode.trace))


class ZeroerPart:
    """The zeroer's part of a zeroer campaign's machine: its start, and the allocations that hand the
    ids over in every way the zeroer contract allows."""

    @initialize(in_flight=st.integers(1, 3), disabled=st.frozensets(st.sampled_from(OPTIONAL_RULES)))
    def start(self, in_flight: int, disabled: frozenset[str]) -> None:
        self.disabled = disabled
        self._apply(op="start", in_flight=in_flight)

    # The same, with what the contract leaves to the caller besides: which cache (one zeroer
    # each), the container the ids come in, and what the caller does with it afterwards.
    @precondition(lambda self: any(g.free for g in self.episode.groups))
    @rule(target=BLOCKS, n=st.integers(1, 3) | st.integers(4, 8), stream=st.integers(0, 2), cache=st.integers(0, 3),
          ids_as=st.sampled_from(IDS_AS), then=st.sampled_from(THEN))
    def allocate_blocks_handed(self, n: int, stream: int, cache: int, ids_as: str, then: str):
        return self._allocate(cache, n, stream, ids_as, then)



class ZeroerMachine(ZeroerPart, CallerMachine):
    """A zeroer campaign's machine: the caller's rules and the zeroer's part."""


def _cache_field(block: BlockRef) -> dict:
    return {"cache": block.cache} if block.cache else {}


def machine_for(config: EpisodeConfig, name: str, *, stats: CampaignStats | None = None,
                journal: Journal | None = None, database_key: bytes | None = None,
                known_bugs: KnownBugs | None = None) -> type[CallerMachine]:
    """A state machine class bound to ``config`` and named ``name`` (a shrunk program says what
    it ran); ``database_key`` identifies its examples in an example database; ``known_bugs`` is
    the run's registry of shrunk bugs (:mod:`fuzz.engine.known_bugs`), None to shrink every finding."""
    label = "".join(c if c.isalnum() else "_" for c in name)
    chosen = chosen_kinds(config)  # the caller's rules and that component's part, or the zeroer's
    bases = (load(COMPONENT_KINDS[chosen[0]].part), CallerMachine) if chosen else (ZeroerMachine,)
    machine = type(label, bases, {"config": config, "stats": stats, "journal": journal, "known_bugs": known_bugs})
    if database_key is not None:
        # Hypothesis keys a stateful test's examples by the machine class; a class made here has
        # no source, so its name and this digest decide (one key per campaign, not per name).
        machine._hypothesis_internal_add_digest = database_key  # type: ignore[attr-defined]
    return machine
