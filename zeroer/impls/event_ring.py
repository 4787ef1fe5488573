"""Our design: a ring of pinned staging slots, each reused only after its event completed. Race-free.

Like the ring of vLLM #48085 it keeps persistent pinned/device staging pairs, so a call costs no
allocator round trip; unlike it, every call records an event behind its zero kernel, and a slot is
reused only once the host has *seen* that event complete (``query_event``). That covers both
hazards of slot reuse: the host rewriting pinned memory a queued copy still reads (#48085), and a
copy on another stream overwriting device ids a queued kernel still reads (the current stream may
change between calls). When every slot is busy the ring grows instead of blocking, so the number
of outstanding calls is unbounded (contract 2); past ``max_slots`` it waits for the oldest slot,
briefly blocking the host (contract 6) rather than growing forever behind a stalled device.

Example::

    z = EventRingZeroer(cache, rt)
    for b in range(1, 6):
        z.zero_block_ids([b])   # a lazy device: the ring grows to 5 slots, nothing is overwritten
"""

from __future__ import annotations

from dataclasses import dataclass

from ..layout import KVCache
from ..runtime import DeviceBuffer, Event, HostBuffer, Runtime
from .common import StagedZeroer

DEFAULT_SLOTS = 2
DEFAULT_SLOT_CAP = 256  # ids per slot before it is re-sized; grows to 2n on demand
DEFAULT_MAX_SLOTS = 64


@dataclass
class _Slot:
    host: HostBuffer
    dev: DeviceBuffer
    event: Event | None = None  # recorded behind the last kernel that read this slot


class EventRingZeroer(StagedZeroer):
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
        super().__init__(cache, runtime, kernel=kernel)
        for name, value in (("slots", slots), ("slot_cap", slot_cap), ("max_slots", max_slots)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if max_slots < slots:
            raise ValueError(f"max_slots={max_slots} is below slots={slots}; raise max_slots")
        self.max_slots = max_slots
        self._slots = [self._new_slot(slot_cap) for _ in range(slots)]
        self._next = 0
        self.grown = 0  # slots added because every slot was busy
        self.waited = 0  # calls that had to wait for a slot (ring at max_slots)

    def _new_slot(self, cap: int) -> _Slot:
        index = len(getattr(self, "_slots", ()))
        return _Slot(
            self.rt.host_buffer(cap),
            self.rt.device_buffer(cap, name=f"event_ring slot {index} ids"),
        )

    @property
    def slot_count(self) -> int:
        return len(self._slots)

    def _acquire(self, n: int) -> int:
        count = len(self._slots)
        for k in range(count):
            i = (self._next + k) % count
            slot = self._slots[i]
            if slot.event is None or self.rt.query_event(slot.event):
                break
        else:
            if count < self.max_slots:
                self._slots.append(self._new_slot(max(n, len(self._slots[0].host))))
                self.grown += 1
                i = count
            else:
                i = self._next
                self.waited += 1
                self.rt.synchronize_event(self._slots[i].event)
        slot = self._slots[i]
        if len(slot.host) < n:
            # The slot is idle (its event completed), so its buffers can be replaced safely.
            self.rt.free_host(slot.host)
            slot.host = self.rt.host_buffer(2 * n)
            slot.dev = self.rt.device_buffer(2 * n, name=f"event_ring slot {i} ids")
        return i

    def zero_block_ids(self, block_ids: list[int]) -> None:
        ids = self._validate(block_ids)
        if not ids:
            return
        n = len(ids)
        with self.rt.annotate(self._origin(ids)):
            i = self._acquire(n)
            slot = self._slots[i]
            self.rt.write_host(slot.host, ids)
            self.rt.copy_h2d(slot.dev, slot.host, n)
            self._launch_zero(slot.dev, n, ids)
            slot.event = self.rt.record_event(slot.event)
            self._next = (i + 1) % len(self._slots)
