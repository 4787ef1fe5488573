"""Our design: a ring of pinned staging slots, each reused only after its event completed. Race-free.

Like the ring of vLLM #48085 it keeps persistent pinned/device staging pairs, so a call costs no
allocator round trip; unlike it, it follows the staging-slot rule
(:mod:`zeroer.designs.staging_ring`): every call records an event behind its zero kernel, and a
slot is rewritten only once the host has *seen* that event complete (``query_event``). When every
slot is busy the ring grows, up to ``max_slots``, then waits for the oldest.

Example::

    z = EventRingZeroer(cache, rt)
    for b in range(1, 6):
        z.zero_block_ids([b])   # a lazy device: the ring grows to 5 slots, nothing is overwritten
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroer.cache.layout import KVCache
from zeroer.designs.common import StagedZeroer
from zeroer.designs.staging_ring import DEFAULT_MAX_SLOTS, DEFAULT_SLOTS, RingSlot, StagingRing
from kvdevice.runtime import DeviceBuffer, Event, HostBuffer, Runtime

DEFAULT_SLOT_CAP = 256  # ids per slot before it is re-sized; grows to 2n on demand


@dataclass
class _Slot(RingSlot):
    # Defaults only so the dataclass can follow RingSlot's; _new_slot sets host and dev.
    host: HostBuffer | None = None
    dev: DeviceBuffer | None = None
    event: Event | None = None  # recorded behind the last kernel that read this slot
    index: int = 0


class EventRingZeroer(StagedZeroer, StagingRing[_Slot]):
    name = "event_ring"

    def __init__(
        self,
        cache: KVCache,
        runtime: Runtime,
        *,
        slots: int = DEFAULT_SLOTS,
        slot_cap: int = DEFAULT_SLOT_CAP,
        max_slots: int = DEFAULT_MAX_SLOTS,
        kernel: str = "triton",
    ) -> None:
        StagedZeroer.__init__(self, cache, runtime, kernel=kernel)
        StagingRing.__init__(self, slots=slots, max_slots=max_slots)
        if not isinstance(slot_cap, int) or slot_cap < 1:
            raise ValueError(f"slot_cap={slot_cap!r} must be a positive int")
        self._slot_cap = slot_cap
        self._open_slots()

    # -- slot operations (staging_ring) ----------------------------------------------------------
    def _new_slot(self) -> _Slot:
        index = len(self._slots)
        cap = max(self._slot_cap, len(self._slots[0].host)) if self._slots else self._slot_cap
        return _Slot(host=self.rt.host_buffer(cap),
                     dev=self.rt.device_buffer(cap, name=f"event_ring slot {index} ids"), index=index)

    def _done(self, slot: _Slot) -> bool:
        return slot.event is None or self.rt.query_event(slot.event)

    def _wait(self, slot: _Slot) -> None:
        if slot.event is not None:
            self.rt.synchronize_event(slot.event)

    # -- the call ------------------------------------------------------------------------------
    def _zero(self, ids: list[int]) -> None:
        n = len(ids)
        slot = self._acquire()
        if len(slot.host) < n:
            # The slot is idle (the host saw its event complete), so its buffers can go.
            self.rt.free_host(slot.host)
            slot.host = self.rt.host_buffer(2 * n)
            slot.dev = self.rt.device_buffer(2 * n, name=f"event_ring slot {slot.index} ids")
        self.rt.write_host(slot.host, ids)
        self.rt.copy_h2d(slot.dev, slot.host, n)
        self._launch_zero(slot.dev, n, ids)
        slot.event = self.rt.record_event(slot.event)
        slot.busy = True
