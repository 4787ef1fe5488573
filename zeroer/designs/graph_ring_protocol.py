"""graph_ring's protocol: CUDA-graph slots on the one staging-slot rule, for both of its forms.

graph_ring is a :class:`~zeroer.designs.staging_ring.StagingRing` (a slot is rewritten only after
the host has *seen* its recorded work complete) whose slots hold CUDA graphs. A call takes an idle
slot, stages its ids there padded with -1 to the next power of two, and replays the slot's graph
for that many ids: the host-to-device copy of the slot and the zero kernel, which skips the
padding. The event recorded behind the graph is the slot's recorded work. A graph holds the
segment table's addresses, so a reallocated cache drops every graph.

Two forms share this code, so the fuzzer proves the protocol on both backends:

* :class:`zeroer.designs.graph_ring.GraphRingZeroer`: real CUDA graphs launched through the
  driver; the production form, fuzzed on the GPU in the free-running mode;
* :class:`zeroer.designs.modelled_graph_ring.ModelledGraphRing`: each graph modelled as the copy
  and kernel it holds, issued through our runtime, so the simulator, the controlled cuda mode
  and the happens-before checker run the same slot choices.

A form supplies the ring's slot operations (``_new_slot``, ``_done``, ``_wait``) and the graph's
(``_stage``, ``_capture``, ``_launch``, ``_record``, ``_zero_unstaged``); everything else is here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from zeroer.cache.layout import KVCache, SegmentTable
from zeroer.designs.common import validate_block_ids
from zeroer.designs.staging_ring import DEFAULT_MAX_SLOTS, DEFAULT_SLOTS, RingSlot, StagingRing

DEFAULT_MAX_GRAPH_IDS = 1024
PAD = -1  # an id the skip_negative kernel zeroes nothing for


def graph_size(n: int) -> int:
    """The id count of the graph a call of ``n`` ids replays: the smallest power of two >= n.

    >>> [graph_size(n) for n in (1, 2, 3, 5, 256, 257)]
    [1, 2, 4, 8, 256, 512]
    """
    return 1 << (n - 1).bit_length()


@dataclass
class GraphSlot(RingSlot):
    """A slot of a graph ring: its captured graphs besides the ring's busy flag."""

    graphs: dict[int, object] = field(default_factory=dict)  # id count -> what _launch replays
    owned: list[object] = field(default_factory=list)  # what the graphs need kept alive


class GraphRingProtocol(StagingRing[GraphSlot]):
    """The ring's graph rules; a form supplies the slot operations (see the module docstring)."""

    name = "graph_ring"

    def __init__(self, cache: KVCache, *, slots: int = DEFAULT_SLOTS, max_slots: int = DEFAULT_MAX_SLOTS,
                 max_graph_ids: int = DEFAULT_MAX_GRAPH_IDS) -> None:
        super().__init__(slots=slots, max_slots=max_slots)
        if not isinstance(max_graph_ids, int) or isinstance(max_graph_ids, bool) or max_graph_ids < 1:
            raise ValueError(f"max_graph_ids={max_graph_ids!r} must be a positive int")
        if max_graph_ids & (max_graph_ids - 1):
            raise ValueError(f"max_graph_ids={max_graph_ids} must be a power of two (graphs are captured "
                             f"for 1, 2, 4, ... ids), e.g. {1 << max_graph_ids.bit_length()}")
        self.cache = cache
        self.num_blocks = cache.spec.num_blocks
        self.max_graph_ids = max_graph_ids
        self._table: SegmentTable = cache.table  # the table the current graphs were captured for
        self.captures = 0  # graphs captured, recaptures after a reallocation included
        self.unstaged_calls = 0  # calls of more than max_graph_ids ids (fresh staging, as per_call)

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

    def _replay(self, slot: GraphSlot, ids: list[int]) -> None:
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

    def close(self) -> None:
        """Wait for the work queued on every slot, then release the graphs.

        Call it when done with the ring (the fuzzer does at the end of every episode); dropping
        the ring calls it too. Waiting first matters: an allocator would hand a slot's pinned
        memory to someone else at once, while a queued copy may still read it (#48085 again).
        Releasing the graphs here, not whenever the garbage collector gets to them, keeps their
        destruction out of another ring's graph capture (see GraphRingZeroer._capture).
        """
        self._drain_slots()
        for slot in self._slots:
            slot.graphs.clear()
            slot.owned.clear()

    # -- graphs ------------------------------------------------------------------------------------
    def _retarget(self, table: SegmentTable) -> None:
        # The cache was reallocated: every graph holds the old table's addresses. A graph still
        # queued keeps what it needs until it completes (each form's _capture says how).
        for slot in self._slots:
            slot.graphs.clear()
            slot.owned.clear()
        self._table = table

    # -- what a form supplies ------------------------------------------------------------------------
    def _stage(self, slot: GraphSlot, ids: list[int]) -> None:
        """Write checked ``ids`` into the idle slot's host memory, -1 up to graph_size(len(ids))."""
        raise NotImplementedError

    def _capture(self, slot: GraphSlot, count: int) -> object:
        """Build the slot's graph for ``count`` ids against ``self._table``."""
        raise NotImplementedError

    def _launch(self, slot: GraphSlot, graph: object, ids: list[int]) -> None:
        """Queue ``graph`` on the current stream."""
        raise NotImplementedError

    def _record(self, slot: GraphSlot) -> None:
        """Record the slot's event on the current stream, behind the graph just launched."""
        raise NotImplementedError

    def _zero_unstaged(self, ids: list[int]) -> None:
        """More ids than the largest graph: stage them in fresh pinned memory (each form hands
        them to its per_call counterpart)."""
        raise NotImplementedError
