"""An offload campaign's rules: the offloader's part of the state machine (fuzz.engine.machine
builds a campaign's machine from the caller's rules, :class:`~fuzz.engine.machine.CallerMachine`,
and the part its component kind names in fuzz.engine.component.COMPONENT_KINDS)."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis import target
from hypothesis.control import currently_in_test_context
from hypothesis.stateful import initialize, multiple, precondition, rule

from fuzz.engine.machine import BLOCKS, OPTIONAL_RULES, BlockRef


class OffloadPart:
    """An offload campaign's part (fuzz.engine.offload), on blocks the harness's reference zeroer
    zeroes: storing blocks into host slots, loading stored slots into free blocks, evicting slots
    and polling the offloader for finished jobs. A block under a job not yet reported finished is
    kept from the caller (a rule drawn for it does nothing); a slot is chosen among those the op
    may take now (``slot=0``: the first of them), so every drawn load and eviction happens. Not
    drawn here: the containers a zero call's ids come in (the zeroer's contract; the reference
    zeroer is not under test, and fewer rules bring the offloader's interleavings sooner)."""

    # The caller's optional rules may be left out (its swarm); the offloader's are not: Hypothesis
    # already leaves each rule out of an example at a rate of its own drawing, and a second swarm
    # over evict_slot kept it out of two programs in three. SGLang #27444 needs allocate, store,
    # load and evict in one program: with it, 3 of 16 seeds of 40 examples found it; without, 7
    # (fuzz.engine.machine runs, no shrinking; docs/fuzzing.md has the figures of `pytest fuzz`).
    # ``blocks``: the program starts holding some (an initializer is never left out, the allocate
    # rule may be: a quarter of the examples allocated nothing); 9 of 16 with both.
    @initialize(target=BLOCKS, in_flight=st.integers(1, 3), disabled=st.frozensets(st.sampled_from(OPTIONAL_RULES)),
                blocks=st.integers(0, 3))
    def start(self, in_flight: int, disabled: frozenset[str], blocks: int):
        self.disabled = disabled
        self._apply(op="start", in_flight=in_flight)
        return self._allocate(0, blocks, 0, "list", "keep") if blocks else multiple()

    def _evictable(self) -> list[int]:
        """Stored slots no job in flight uses; with an offloader that frees slots itself (its
        ``evict``), every stored slot: the caller asks, and the offloader's host lock answers."""
        offload = self.episode.component
        asks = offload.offloader.evicts
        return [i for i, s in enumerate(offload.slots) if s.state == "stored" and (asks or not s.loads)]

    @precondition(lambda self: bool(self.episode.component.free_slots))
    @rule(block=BLOCKS, stream=st.integers(0, 2))
    def store_block(self, block: BlockRef, stream: int) -> None:
        if not block.cache and self._usable(block) and block.block not in self.episode.component.busy:
            self._apply(op="store", block=block.block, stream=self._n_streams(stream))

    def _loadable(self) -> list[int]:
        return [i for i, s in enumerate(self.episode.component.slots) if s.state in ("stored", "storing")]

    # A slot whose store is still in flight may be chosen too: the caller then waits for it first,
    # as an engine resuming a request waits for its KV to be saved (the offloader's wait(job_ids)).
    @precondition(lambda self: bool(self.episode.groups[0].free) and bool(self._loadable()))
    @rule(target=BLOCKS, slot=st.integers(0, 7), stream=st.integers(0, 2), oldest=st.booleans())
    def load_slot(self, slot: int, stream: int, oldest: bool):
        candidates = self._loadable()
        chosen = candidates[slot % len(candidates)]
        if self.episode.component.slots[chosen].state == "storing":
            self._apply(op="wait", slot=chosen)
            if self._free_running():
                self._apply(op="poll", sync=1)
            if self.episode.component.slots[chosen].state != "stored" or not self.episode.groups[0].free:
                return multiple()  # not reported even then: the end of the episode judges it
        block = self._apply(op="load", slot=chosen, stream=self._n_streams(stream), **({"oldest": 1} if oldest else {}))
        return BlockRef(block, 0, self.episode.owners)

    @precondition(lambda self: bool(self._evictable()))
    @rule(slot=st.integers(0, 7))
    def evict_slot(self, slot: int) -> None:
        evictable = self._evictable()
        self._apply(op="evict", slot=evictable[slot % len(evictable)])

    # The caller's advance_stream steers its own streams only: the offloader's run only as far as a
    # host synchronisation needs, so a job reported once its stream has passed the start event, or
    # the first layer's event of a layer-by-layer transfer, while its copies are still queued, shows
    # only if its streams run part-way before a poll: ``own`` ops of each that has work queued.
    @rule(sync=st.booleans(), own=st.integers(0, 3))
    def poll_finished(self, sync: bool, own: int) -> None:
        sync = sync or self._free_running()
        if own and not sync and self._enabled("advance_stream"):
            side = self.episode.component
            for stream, queued in enumerate(side.own_work_by_stream()):
                if queued:
                    self._apply(op="advance_own", stream=stream, ops=own)
        self._apply(op="poll", **({"sync": 1} if sync else {}))

    def _free_running(self) -> bool:
        """On a GPU running free (no gates), which jobs a poll hears of is the GPU's timing, and the
        rules Hypothesis may draw next follow from it (a slot becomes evictable, a load's block
        joins the bundle): a run must draw the same way every time (its FlakyStrategyDefinition
        otherwise), so there the caller waits for the device before each poll. Reports made
        before a copy ran are the controlled mode's to find."""
        config = self.episode.config
        return config.backend == "cuda" and config.mode == "free"

    def _usable(self, block: BlockRef, *, reading: bool = False) -> bool:
        """An offload job on ``block`` keeps it from the caller until the job is reported finished
        (a store lets it be read meanwhile)."""
        offload = self.episode.component
        if block.cache:
            return True
        job = offload.busy.get(block.block)
        if job is None:
            return self.episode.groups[0].shadow.blocks[block.block].state == "live"
        return reading and offload.jobs[job].kind == "store"

    def _target_component(self) -> None:
        episode = self.episode
        if episode is not None and not episode.finished and not episode.in_op and currently_in_test_context():
            # Targeting: programs whose jobs finish and come back (store, report, load) go deeper.
            target(float(len(episode.component.reported)), label="offload jobs reported finished")
