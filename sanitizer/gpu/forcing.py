"""Force mode: queued copies to and from pinned memory held behind gate kernels until the host synchronises.

In observe mode a race is reported from enqueue order, and the values usually come out right
because the copy ran before the host got to its access. Force mode makes them come out wrong when
they can: every non-blocking copy from or to pinned memory, every kernel reading pinned memory and
every CUDA graph replay is issued behind a gate kernel (:class:`racecheck.gate.GatePool`: a one-warp
kernel spinning on a pinned flag) on its stream, so it runs only when the host next waits for the
GPU: an event, stream or device synchronisation, a ``query``, a blocking copy or ``.item()`` of a
device tensor, a pinned allocation, a first launch of a Triton kernel (loading its module waits for
the GPU), ``empty_cache``, or the end of the test. A held host-to-device copy then reads what the
host wrote in between: just before the gates open, the bytes each held copy is about to read are
compared with what was staged when it was queued, and a difference is reported with the values. A
held device-to-host copy has not landed when the host reads early, so the host reads stale bytes and
the program's own check fails; the copies still held when it fails (:meth:`Forcing.held_writes`)
let such a failure name the copy when the read itself was not seen (sanitizer.runner).

A host call that waits for the GPU without any of those signs (a ``cudaFree`` inside the allocator,
another library's synchronisation) would wait behind a gate forever: every gate opens by itself
after :data:`HOLD_LIMIT_S` seconds, which only closes the window early (``timeouts`` counts it),
never makes a race up.

Example (needs a GPU)::

    forcing = Forcing()
    held = forcing.hold(torch.cuda.current_stream())     # before the copy is issued
    dst.copy_(pinned, non_blocking=True)                  # queued behind the gate
    held.reads.append(snapshot)                           # the bytes it will read (racecheck.pinned.Snapshot)
    delivered = forcing.release()                         # [(snapshot, bytes it read)] that differ
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

HOLD_LIMIT_S = 2.0
MAX_HELD = 64  # gates spinning at once; beyond it the oldest are released (each holds an SM busy)


@dataclass(eq=False)
class Held:
    gate: Any
    done: Any  # an event recorded behind the gate: its flag is recycled once it completed
    reads: list = field(default_factory=list)  # snapshots of the pinned bytes held copies read
    writes: list = field(default_factory=list)  # (region, access) of held device-to-host copies
    expired: bool = False  # opened by the time limit: what its copies read is not known


class Forcing:
    """The gates of one sanitized process (see the module docstring)."""

    def __init__(self) -> None:
        from racecheck.gate import GatePool, request_hardware_queues

        request_hardware_queues()  # a stream sharing a hardware queue with a gated one would stall too
        self.pool = GatePool()
        self._held: list[Held] = []
        self._launched: set[int] = set()
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self.timeouts = 0

    @property
    def holding(self) -> bool:
        return bool(self._held)

    def hold(self, stream: Any) -> Held:
        """A closed gate on ``stream`` (a ``torch.cuda.Stream``): what is queued next waits for it."""
        if len(self._held) >= MAX_HELD:
            self.release()
        gate = self.pool.acquire()
        self.pool.launch(gate, stream)
        done = torch.cuda.Event()
        done.record(stream)
        held = Held(gate, done)
        with self._lock:
            self._held.append(held)
            if self._timer is None:
                self._timer = threading.Timer(HOLD_LIMIT_S, self._expire)
                self._timer.daemon = True
                self._timer._kvz_own = True  # type: ignore[attr-defined]  # the sanitizer's own: not followed
                self._timer.start()
        return held

    def held_writes(self) -> list[tuple[Any, Any]]:
        """The device-to-host copies held behind a gate now, not yet released: (region, access).
        Only these can explain a failure as a host read the sanitizer did not see; a copy released
        at a synchronisation had delivered its bytes before the host went on."""
        with self._lock:
            return [write for item in self._held for write in item.writes]

    def first_launch(self, jit: Any) -> bool:
        """Whether this Triton kernel is launched for the first time (its module is not loaded yet)."""
        key = id(jit)
        if key in self._launched:
            return False
        self._launched.add(key)
        return True

    def release(self, site: Any = None) -> list[tuple[Any, np.ndarray]]:
        """Open every gate (``site``: the program line the host waits at); the held reads whose
        bytes changed since they were queued, with the bytes they read now (none when a gate had
        already opened by itself)."""
        with self._lock:
            held, self._held = self._held, []
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        changed: list[tuple[Any, np.ndarray]] = []
        for item in held:
            if not item.expired:
                for snapshot in item.reads:
                    if snapshot.changed():
                        changed.append((snapshot, snapshot.now()))
            self.pool.open(item.gate)
            self.pool.retire(item.gate, item.done)
        return changed

    def _expire(self) -> None:
        with self._lock:
            self._timer = None  # the next gate held arms a new one
            if not self._held:
                return
            for item in self._held:
                item.expired = True
            self.timeouts += 1
        self.pool.open_all()  # host memory writes only: safe while the host is stuck in a CUDA call

    def close(self) -> None:
        self.release()
        self.pool.open_all()


def shown_values(array: np.ndarray, dtype: torch.dtype, limit: int = 8) -> str:
    """A few of ``array``'s elements (same-width integers of ``dtype``) as ``dtype`` values."""
    flat = array.reshape(-1)
    numpy_dtype = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}.get(dtype)
    values = flat.view(numpy_dtype) if numpy_dtype is not None and flat.dtype.itemsize == np.dtype(numpy_dtype).itemsize \
        else flat
    shown = ", ".join(str(v) for v in values[:limit].tolist())
    return f"[{shown}{', ...' if flat.size > limit else ''}]"
