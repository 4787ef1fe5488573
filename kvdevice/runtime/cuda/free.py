"""The free-running cuda runtime: ops go straight to their streams and real timing decides.

``CudaRuntime(mode="free")`` (``scheduled = False``) issues every op on its stream when it is
enqueued; ``delay`` is ``torch.cuda._sleep``, which is how the vLLM #48085 overwrite was
reproduced on an H200. ``advance`` does nothing and ``pending`` is 0. Only a ``hold`` uses a gate
(:mod:`racecheck.gate`); since the runtime cannot tell which work a sync needs, any
sync while a hold is unreleased raises :class:`~zeroer.errors.DeadlockError` instead of hanging.

``checked=False`` (this mode only) is for measuring a zeroer, not for finding races: no
happens-before checker, labels or annotations, no allocator clocks, no watchdog around calls
while no hold is placed, and no stream switch for an op on the stream that is already torch's
current one (``use_stream``). ``python -m fuzz.bench.kernel`` times each design both ways.

Example (needs a GPU)::

    from kvdevice.runtime.cuda import CudaRuntime
    rt = CudaRuntime(mode="free")
    host, dev = rt.host_buffer(1), rt.device_buffer(1)
    rt.write_host(host, [1])
    rt.delay(rt.default_stream, 500)    # ~50 ms of device sleep: the copy stays queued
    rt.copy_h2d(dev, host)
    rt.write_host(host, [2])            # a hazard, whatever the copy ends up reading
    rt.synchronize()
    assert rt.hazards
    rt.close()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Callable

import torch

from racecheck.errors import DeadlockError
from kvdevice.runtime.base import DeviceBuffer, Event, Hold, HostBuffer, Runtime, Stream
from racecheck import real_cuda
from kvdevice.runtime.cuda.common import CudaRuntimeBase
from racecheck.hb import OpStamp

DELAY_CYCLES_PER_UNIT = 200_000  # torch.cuda._sleep cycles per delay unit: ~0.1 ms at ~2 GHz (H200)
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what Triton uses too


class FreeCudaRuntime(CudaRuntimeBase):
    """The cuda backend with ops issued as they come. See the module docstring."""

    mode = "free"
    scheduled = False

    def _before_cuda_starts(self) -> None:
        self._held: list[Hold] = []  # unreleased holds

    # -- issuing -----------------------------------------------------------------------------
    def _submit(self, stream: Stream, kind: str, label: str, issue: Callable[[], None] | None = None,
                **fields: object) -> int:
        """Issue the work on ``stream`` now (every op of this mode has some; ``fields`` are the
        controlled model's)."""
        if self._fast():
            if self._is_torch_current(stream):
                issue()
            else:
                with self._on(stream):
                    issue()
            return 0
        with self._guarded(label), self._on(stream):
            issue()
        return 0

    def _fast(self) -> bool:
        """Unchecked and nothing held: no gate can spin, so host calls need no watchdog."""
        return not self.checked and not self._held

    def _is_torch_current(self, stream: Stream) -> bool:
        # Two C calls (~0.3 us) instead of entering torch.cuda.stream (several us).
        return (
            _current_raw_stream is not None
            and real_cuda.current_device() == self.device.index
            and _current_raw_stream(self.device.index) == stream.handle.cuda_stream
        )

    @contextlib.contextmanager
    def ungated(self) -> Iterator[None]:
        """A plain scope (nothing is gated here but holds), on a runtime that is still usable."""
        self._check_usable()
        yield

    # -- events ------------------------------------------------------------------------------
    def _event_done(self, event: Event) -> bool:
        self._check_usable()
        return bool(event.handle.query())

    def _before_sync(self, what: str, stream: int | None = None, position: int | None = None) -> None:
        """A sync behind a shut gate would hang the host, and we cannot tell which work the sync
        needs, so any unreleased hold makes every sync a deadlock."""
        if self._held:
            held = ", ".join(h.label for h in self._held)  # labels name their streams
            raise DeadlockError(
                f"deadlock: {what} would wait forever behind {held}; "
                f"a free-running runtime cannot tell which work a sync needs, so call release() "
                f"on every hold before synchronising"
            )

    # -- memory: the checked=False fast paths --------------------------------------------------
    def _alloc_host(self, n: int, dtype: torch.dtype, protected: bool) -> HostBuffer:
        if protected and self._fast():  # no watchdog, no allocator clocks: nothing reads them
            self._check_usable()
            return HostBuffer(next(self._block_ids), torch.empty(n, dtype=dtype, pin_memory=True), protected=True)
        return super()._alloc_host(n, dtype, protected)

    def device_buffer(self, n: int, dtype: torch.dtype = torch.int64, *, name: str | None = None) -> DeviceBuffer:
        if not self._fast():
            return super().device_buffer(n, dtype, name=name)
        self._check_usable()
        with real_cuda.device(self.device):  # no watchdog: Runtime's allocation, not the base's guarded one
            return Runtime.device_buffer(self, n, dtype, name=name)

    # -- work --------------------------------------------------------------------------------
    def _delay(self, stream: Stream, amount: int, stamp: OpStamp) -> None:
        self._check_usable()
        self._submit(stream, "sleep", stamp.label, lambda: real_cuda._sleep(amount * DELAY_CYCLES_PER_UNIT))

    def _hold(self, hold: Hold, stamp: OpStamp) -> None:
        self._check_usable()
        with self._guarded(stamp.label), self._on(hold.stream):
            gate = self.gates.acquire()
            self.gates.launch(gate, hold.stream.handle)
            done = real_cuda.Event()
            done.record(hold.stream.handle)
        hold.payload["gate"], hold.payload["done"] = gate, done
        self._held.append(hold)

    def _release(self, hold: Hold) -> None:
        self._check_usable()
        self.gates.open(hold.payload["gate"])
        self.gates.retire(hold.payload["gate"], hold.payload["done"])
        self._held = [h for h in self._held if h is not hold]

    def _advance(self, stream: Stream, ops: int) -> int:
        self._check_usable()
        return 0  # timing decides what runs
