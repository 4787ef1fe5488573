"""The staging-slot rule every ring design follows, written once.

A ring keeps persistent staging slots (pinned host ids, device ids, whatever records when the
slot's last work ran). A call takes an idle slot, stages its ids there, queues the work that reads
them, records behind it, and marks the slot busy. The rule that makes this race-free: **a busy
slot is rewritten only after the host has seen its recorded work complete.** That covers both
hazards of slot reuse: the host rewriting pinned memory a queued copy still reads (vLLM #48085),
and a copy on another stream overwriting device ids a queued kernel still reads (the current
stream may change between calls). A ring sized by depth alone, with no such check, is #48085's
ring, which broke once more calls were outstanding than slots; #48399 dropped the ring.

When every slot is busy the ring grows instead of blocking, so the number of outstanding calls is
unbounded (contract 2); past ``max_slots`` it waits for the oldest, briefly blocking the host
(contract 6) rather than growing without bound behind a stalled device.

Users: :class:`zeroer.designs.event_ring.EventRingZeroer` (slots of runtime buffers and events)
and :class:`zeroer.designs.graph_ring_protocol.GraphRingProtocol` (slots with CUDA graphs, in
both of its forms). A form supplies three slot operations: ``_new_slot``, ``_done`` (does the host
see the slot's recorded work complete? never blocks) and ``_wait`` (block until it does).

Example::

    class Ring(StagingRing[RingSlot]):
        def _new_slot(self): return RingSlot()
        def _done(self, slot): return True
        def _wait(self, slot): pass

    ring = Ring(slots=2, max_slots=4)
    ring._open_slots()
    slot = ring._acquire(); slot.busy = True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

DEFAULT_SLOTS = 2
DEFAULT_MAX_SLOTS = 64


@dataclass
class RingSlot:
    """What every slot has: whether work that reads it may still be queued."""

    busy: bool = False  # work was queued since the host last saw the slot's recorded work complete


SlotT = TypeVar("SlotT", bound=RingSlot)


class StagingRing(Generic[SlotT]):
    """Slots, and which one a call may stage into (see the module docstring)."""

    def __init__(self, *, slots: int = DEFAULT_SLOTS, max_slots: int = DEFAULT_MAX_SLOTS) -> None:
        for name, value in (("slots", slots), ("max_slots", max_slots)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if max_slots < slots:
            raise ValueError(f"max_slots={max_slots} is below slots={slots}; raise max_slots")
        self.max_slots = max_slots
        self._initial_slots = slots
        self._slots: list[SlotT] = []
        self._next = 0
        self.grown = 0  # slots added because every slot was busy
        self.waited = 0  # calls that waited for a slot (the ring at max_slots)

    def _open_slots(self) -> None:
        """Make the first slots; a form calls it once its own state is ready."""
        self._slots = [self._new_slot() for _ in range(self._initial_slots)]

    @property
    def slot_count(self) -> int:
        return len(self._slots)

    def _acquire(self) -> SlotT:
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

    def _drain_slots(self) -> None:
        """Wait for the work queued on every busy slot (before its memory may be released)."""
        for slot in self._slots:
            if slot.busy:
                self._wait(slot)
                slot.busy = False

    # -- what a form supplies ----------------------------------------------------------------------
    def _new_slot(self) -> SlotT:
        raise NotImplementedError

    def _done(self, slot: SlotT) -> bool:
        """Whether the host sees the slot's last recorded work complete (never blocks)."""
        raise NotImplementedError

    def _wait(self, slot: SlotT) -> None:
        """Block the host until the slot's last recorded work completed."""
        raise NotImplementedError
