"""graph_ring's protocol on our runtime, each CUDA graph modelled as the copy and kernel it holds.

The CUDA form (:mod:`zeroer.designs.graph_ring`) launches real graphs through the driver, which
neither the simulator nor the happens-before checker can see. This form runs the very same slot
protocol (:mod:`zeroer.designs.graph_ring_protocol`: which slot, when to grow, when to wait, when to
recapture) with each operation issued through a :class:`~kvdevice.runtime.Runtime`, so the fuzzer
checks it on the simulator and in the controlled cuda mode, hazards included:

* staging is ``write_host`` of the ids and their -1 padding into the slot's pinned buffer: the
  host write that #48085 made race;
* a graph is what capturing records: the segment table it was captured against and its id
  count. Replaying it issues the copy of ``count`` ids from the slot and the ``skip_negative``
  zero kernel over them, with that table, so a ring that missed a reallocation would zero the
  old cache here as the real graph would;
* the slot's event is a runtime event, queried (never blocking) before the slot is reused.

Example::

    rt = make_runtime("sim")
    z = ModelledGraphRing(cache, rt)
    z.zero_block_ids([3, 9])   # slot 0's 2-id graph: a copy of 2 ids, then the kernel
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from zeroer.designs.common import StagedZeroer
from zeroer.designs.per_call import PerCallZeroer
from zeroer.kernel import zero_blocks
from zeroer.protocol import Capabilities, IDS_CONTAINERS
from zeroer.cache.layout import KVCache, SegmentTable
from kvdevice.runtime import Runtime
from zeroer.designs.graph_ring_protocol import DEFAULT_MAX_GRAPH_IDS, DEFAULT_MAX_SLOTS, DEFAULT_SLOTS, PAD, GraphRingProtocol, GraphSlot, graph_size


@dataclass
class _Slot(GraphSlot):
    # Defaults only so the dataclass can follow GraphSlot's; _new_slot sets every field.
    host: Any = None  # HostBuffer of max_graph_ids ids
    dev: Any = None  # DeviceBuffer of max_graph_ids ids
    event: Any = None  # the runtime Event recorded behind the slot's last graph
    index: int = 0


@dataclass(frozen=True)
class _Graph:
    """What a captured graph holds: the table its kernel writes through, and its id count."""

    table: SegmentTable
    count: int


class ModelledGraphRing(StagedZeroer, GraphRingProtocol):
    """graph_ring's protocol on ``runtime`` (see the module docstring)."""

    name = GraphRingProtocol.name
    capabilities = Capabilities(api="runtime", ids_as=IDS_CONTAINERS, follows_reallocation=True)

    def __init__(self, cache: KVCache, runtime: Runtime, *, slots: int = DEFAULT_SLOTS,
                 max_slots: int = DEFAULT_MAX_SLOTS, max_graph_ids: int = DEFAULT_MAX_GRAPH_IDS) -> None:
        GraphRingProtocol.__init__(self, cache, slots=slots, max_slots=max_slots, max_graph_ids=max_graph_ids)
        StagedZeroer.__init__(self, cache, runtime)  # checks the devices; labels each call in zero_block_ids
        self._unstaged = PerCallZeroer(cache, runtime)  # calls of more than max_graph_ids ids
        self._open_slots()

    _zero = GraphRingProtocol._zero_ids  # called by StagedZeroer.zero_block_ids with checked, non-empty ids

    # -- slot operations (ring_protocol) ----------------------------------------------------------
    def _new_slot(self) -> _Slot:
        index = len(self._slots)
        return _Slot(host=self.rt.host_buffer(self.max_graph_ids),
                     dev=self.rt.device_buffer(self.max_graph_ids, name=f"graph_ring slot {index} ids"),
                     index=index)

    def _done(self, slot: _Slot) -> bool:
        return slot.event is None or self.rt.query_event(slot.event)

    def _wait(self, slot: _Slot) -> None:
        if slot.event is not None:
            self.rt.synchronize_event(slot.event)

    def _stage(self, slot: _Slot, ids: list[int]) -> None:
        self.rt.write_host(slot.host, ids + [PAD] * (graph_size(len(ids)) - len(ids)))

    def _capture(self, slot: _Slot, count: int) -> _Graph:
        return _Graph(self._table, count)

    def _launch(self, slot: _Slot, graph: object, ids: list[int]) -> None:
        assert isinstance(graph, _Graph)
        self.rt.copy_h2d(slot.dev, slot.host, graph.count)
        run = functools.partial(zero_blocks, graph.table, slot.dev.tensor[: graph.count], skip_negative=True)
        self.rt.launch(run, name="zero_kernel (graph)", reads=[slot.dev], blocks_written=ids)

    def _record(self, slot: _Slot) -> None:
        slot.event = self.rt.record_event(slot.event)

    def _zero_unstaged(self, ids: list[int]) -> None:
        # per_call's staging: a fresh block from the caching host allocator, dropped once queued.
        self._unstaged.zero_block_ids(ids)
