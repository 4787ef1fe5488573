"""graph_ring's slot protocol, written once for both of its forms.

A graph ring keeps persistent staging slots (pinned host ids, device ids, an event). A call takes
an idle slot, stages its ids there padded with -1 to the next power of two, and replays the
slot's graph for that many ids: the host-to-device copy of the slot and the zero kernel, which
skips the padding. The event recorded behind the graph says when the slot may be rewritten.
What makes that race-free is the rule this module implements: a slot is rewritten only after the
host has *seen* its event complete, which covers the host rewriting pinned memory a queued copy
still reads (vLLM #48085) and a copy on another stream overwriting device ids a queued kernel
still reads. When every slot is busy the ring grows, up to ``max_slots``, then waits for the
oldest. A graph holds the segment table's addresses, so a reallocated cache drops every graph.

Two forms share this code, so the fuzzer proves the protocol on both backends:

* :class:`zeroer.direct.graph_ring.GraphRingZeroer`: real CUDA graphs launched through the
  driver; the production form, fuzzed on the GPU in the free-running mode;
* :class:`zeroer.direct.modelled_graph_ring.ModelledGraphRing`: each graph modelled as the copy
  and kernel it holds, issued through our runtime, so the simulator, the controlled cuda mode
  and the happens-before checker run the same slot choices.

A form supplies the slot operations (``_new_slot``, ``_done``, ``_wait``, ``_stage``,
``_capture``, ``_launch``, ``_record``, ``_zero_unstaged``); everything else is here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ..impls.common import validate_block_ids
from ..layout import KVCache, SegmentTable

DEFAULT_SLOTS = 2
DEFAULT_MAX_SLOTS = 64
DEFAULT_MAX_GRAPH_IDS = 1024
PAD = -1  # an id the skip_negative kernel zeroes nothing for


def graph_size(n: int) -> int:
    """The id count of the graph a call of ``n`` ids replays: the smallest power of two >= n.

    >>> [graph_size(n) for n in (1, 2, 3, 5, 256, 257)]
    [1, 2, 4, 8, 256, 512]
    """
    return 1 << (n - 1).bit_length()


@dataclass
class RingSlot:
    """What every form's slot has: whether work that reads it may still be queued, and its graphs."""

    busy: bool = False  # a graph was launched since the host last saw the slot's event complete
    graphs: dict[int, object] = field(default_factory=dict)  # id count -> what _launch replays
    owned: list[object] = field(default_factory=list)  # what the graphs need kept alive


class GraphRingProtocol:
    """The ring's rules; a subclass supplies the slot operations (see the module docstring)."""

    name = "graph_ring"
    follows_reallocation = True  # it reads cache.table on every call

    def __init__(self, cache: KVCache, *, slots: int = DEFAULT_SLOTS, max_slots: int = DEFAULT_MAX_SLOTS,
                 max_graph_ids: int = DEFAULT_MAX_GRAPH_IDS) -> None:
        for name, value in (("slots", slots), ("max_slots", max_slots), ("max_graph_ids", max_graph_ids)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if max_slots < slots:
            raise ValueError(f"max_slots={max_slots} is below slots={slots}; raise max_slots")
        if max_graph_ids & (max_graph_ids - 1):
            raise ValueError(f"max_graph_ids={max_graph_ids} must be a power of two (graphs are captured "
                             f"for 1, 2, 4, ... ids), e.g. {1 << max_graph_ids.bit_length()}")
        self.cache = cache
        self.num_blocks = cache.spec.num_blocks
        self.max_slots = max_slots
        self.max_graph_ids = max_graph_ids
        self._initial_slots = slots
        self._table: SegmentTable = cache.table  # the table the current graphs were captured for
        self._slots: list[RingSlot] = []
        self._next = 0
        self.grown = 0  # slots added because every slot was busy
        self.waited = 0  # calls that waited for a slot (the ring at max_slots)
        self.captures = 0  # graphs captured, recaptures after a reallocation included
        self.unstaged_calls = 0  # calls of more than max_graph_ids ids (fresh staging, as per_call)

    def _open_slots(self) -> None:
        """Make the first slots; a subclass calls it once its own state is ready."""
        self._slots = [self._new_slot() for _ in range(self._initial_slots)]

    # -- the call ------------------------------------------------------------------------------
    def zero_block_ids(self, block_ids: Iterable[int] | None) -> None:
        ids = validate_block_ids(block_ids, self.num_blocks)
        if ids:
            self._zero_ids(ids)

    def _zero_ids(self, ids: list[int]) -> None:
        """Zero checked, non-empty ``ids``."""
        if len(ids) > self.max_graph_ids:
            self.unstaged_calls += 1
            self._zero_unstaged(ids)
            return
        slot = self._acquire()
        self._stage(slot, ids)
        self._replay(slot, ids)

    def _replay(self, slot: RingSlot, ids: list[int]) -> None:
        """Queue the slot's graph for ``ids`` (staged in the slot) on the current stream."""
        count = graph_size(len(ids))
        if self.cache.table is not self._table:
            self._retarget(self.cache.table)
        graph = slot.graphs.get(count)
        if graph is None:
            graph = slot.graphs[count] = self._capture(slot, count)
            self.captures += 1
        self._launch(slot, graph, ids)
        self._record(slot)
        slot.busy = True

    def warmup(self) -> None:
        """Zero the null block 0, as vLLM's warm-up does (captures slot 0's one-id graph)."""
        self.zero_block_ids([0])

    @property
    def slot_count(self) -> int:
        return len(self._slots)

    def close(self) -> None:
        """Wait for the work queued on every slot, then release the graphs.

        Call it when done with the ring (the fuzzer does at the end of every episode); dropping
        the ring calls it too. Waiting first matters: an allocator would hand a slot's pinned
        memory to someone else at once, while a queued copy may still read it (#48085 again).
        Releasing the graphs here, not whenever the garbage collector gets to them, keeps their
        destruction out of another ring's graph capture (see GraphRingZeroer._capture).
        """
        for slot in self._slots:
            if slot.busy:
                self._wait(slot)
                slot.busy = False
            slot.graphs.clear()
            slot.owned.clear()

    # -- slots -----------------------------------------------------------------------------------
    def _acquire(self) -> RingSlot:
        """An idle slot: the next one if the host has seen it complete, else any idle one, else a
        new one (below max_slots), else the next one once its work is done."""
        slot = self._slots[self._next]
        if not slot.busy or self._done(slot):  # the common case, without the loop
            slot.busy = False
            self._next = (self._next + 1) % len(self._slots)
            return slot
        count = len(self._slots)
        for k in range(1, count):
            i = (self._next + k) % count
            slot = self._slots[i]
            if not slot.busy or self._done(slot):
                break
        else:
            if count < self.max_slots:
                self._slots.append(self._new_slot())
                self.grown += 1
                i = count
            else:
                i = self._next
                self.waited += 1
                self._wait(self._slots[i])
        slot = self._slots[i]
        slot.busy = False
        self._next = (i + 1) % len(self._slots)
        return slot

    def _retarget(self, table: SegmentTable) -> None:
        # The cache was reallocated: every graph holds the old table's addresses. A graph still
        # queued keeps what it needs until it completes (each form's _capture says how).
        for slot in self._slots:
            slot.graphs.clear()
            slot.owned.clear()
        self._table = table

    # -- what a form supplies ------------------------------------------------------------------------
    def _new_slot(self) -> RingSlot:
        raise NotImplementedError

    def _done(self, slot: RingSlot) -> bool:
        """Whether the host sees the slot's last recorded work complete (never blocks)."""
        raise NotImplementedError

    def _wait(self, slot: RingSlot) -> None:
        """Block the host until the slot's last recorded work completed."""
        raise NotImplementedError

    def _stage(self, slot: RingSlot, ids: list[int]) -> None:
        """Write checked ``ids`` into the idle slot's host memory, -1 up to graph_size(len(ids))."""
        raise NotImplementedError

    def _capture(self, slot: RingSlot, count: int) -> object:
        """Build the slot's graph for ``count`` ids against ``self._table``."""
        raise NotImplementedError

    def _launch(self, slot: RingSlot, graph: object, ids: list[int]) -> None:
        """Queue ``graph`` on the current stream."""
        raise NotImplementedError

    def _record(self, slot: RingSlot) -> None:
        """Record the slot's event on the current stream, behind the graph just launched."""
        raise NotImplementedError

    def _zero_unstaged(self, ids: list[int]) -> None:
        """More ids than the largest graph: stage them in fresh pinned memory (each form hands
        them to its per_call counterpart)."""
        raise NotImplementedError
