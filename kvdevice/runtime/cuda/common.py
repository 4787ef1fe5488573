"""What both cuda runtimes share: one GPU, its streams, events and memory, and never a hang.

:class:`CudaRuntimeBase` holds everything that is the same in the controlled
(:mod:`kvdevice.runtime.cuda.controlled`) and the free-running (:mod:`kvdevice.runtime.cuda.free`)
runtime: argument checks, the device, pool streams claimed for the runtime's life (never the
legacy default stream), ``torch.cuda.Event`` handles, host and device memory, the gate pool and
its watchdog, and teardown. The subclasses decide how an op reaches its stream.

Memory. Protected host buffers are ``torch.empty(pin_memory=True)``: PyTorch's caching host
allocator records an event behind every non-blocking copy of a block and hands it out again only
after it (pytorch/pytorch#130785). The runtime keeps the join of the clocks of every copy of a
protected block (the allocator clocks); when PyTorch hands the same address out again, the
happens-before checker learns that the host has observed those copies, as on the simulator.
Unprotected buffers come from a :class:`~kvdevice.runtime.cuda.arena.PinnedArena`, reused at once.

A host call stuck behind closed gates longer than ``timeout_s`` is turned into
:class:`~racecheck.gate.GateTimeoutError` after every gate has been opened: never a hang.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import weakref
from abc import abstractmethod
from collections.abc import Iterator
from typing import Callable

import torch

from racecheck.errors import RuntimeUsageError
from kvdevice.runtime.base import DeviceBuffer, Event, HostBuffer, Runtime, Stream
from racecheck import real_cuda, schedules
from kvdevice.runtime.cuda.arena import PinnedArena
from kvdevice.runtime.cuda.device import resolve_device
from racecheck.gate import (
    GatePool,
    GateTimeoutError,
    Watchdog,
    abandon,
    claim_stream,
    gate_available,
    release_streams,
    spare_stream,
)
from racecheck.hb import OpStamp
from racecheck.thread_hooks import unhooked_sleep

DEFAULT_TIMEOUT_S = 30.0  # longest one gated op or one guarded host call may take before we give up
POLL_SPIN_S = 2e-4  # busy-poll a done event this long (a gate opens in ~20 us), then back off


def _join(a: tuple[int, ...] | None, b: tuple[int, ...]) -> tuple[int, ...]:
    if a is None:
        return b
    n = max(len(a), len(b))
    a, b = a + (0,) * (n - len(a)), b + (0,) * (n - len(b))
    return tuple(max(x, y) for x, y in zip(a, b))


def _abandon(pool: GatePool, watchdog: Watchdog, stream_keys: list[tuple[int, int]]) -> None:
    """Finaliser of a runtime dropped (or alive at exit) without close(): never leave a gate shut."""
    abandon(pool)
    watchdog.stop()
    release_streams(stream_keys)


class CudaRuntimeBase(Runtime):
    """The parts of the cuda backend both modes share. See the module docstring.

    Build one with ``CudaRuntime(mode=...)`` (:mod:`kvdevice.runtime.cuda`); a subclass sets
    ``mode`` and ``scheduled`` and implements how ops are issued.
    """

    backend = "cuda"
    mode: str = "?"  # "controlled" or "free"

    def __init__(
        self,
        device: int | str | torch.device | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        checked: bool = True,
    ) -> None:
        if not isinstance(checked, bool):
            raise RuntimeUsageError(f"checked={checked!r}: pass True (the default) or False")
        if not checked and self.scheduled:
            raise RuntimeUsageError(
                f"checked=False needs mode='free': the {self.mode} mode's schedule is built on the "
                f"bookkeeping that checked=False skips; use CudaRuntime(mode='free', checked=False)"
            )
        if not real_cuda.is_available():
            raise RuntimeUsageError(
                "backend 'cuda' needs a CUDA GPU and torch.cuda.is_available() is False here; "
                "use backend 'sim' (or 'auto')"
            )
        if not gate_available():
            raise RuntimeUsageError("the cuda backend needs triton for its gate kernel; install triton or use backend 'sim'")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise RuntimeUsageError(f"timeout_s {timeout_s!r} must be a positive number of seconds")
        self._before_cuda_starts()
        # A sanitizer watching this process steps aside while this runtime runs: its gates order
        # streams in a way no torch hook shows (racecheck.schedules).
        schedules.started(self, "kvzero's CUDA harness runtime")
        try:
            self._start(device, timeout_s, checked)
        except BaseException:
            schedules.ended(self)
            raise

    def _start(self, device: int | str | torch.device | None, timeout_s: float, checked: bool) -> None:
        device = resolve_device(device, real_cuda.device_count(), real_cuda.current_device())
        # Base __init__ creates the "main" stream through our hooks, so everything they use is set
        # up first (as SimRuntime does with its queues).
        self.device = device
        self.checked = checked  # read by Runtime.__init__
        self.timeout_s = float(timeout_s)
        self._closed = False
        self._lost: str | None = None  # why this runtime stopped following its schedule
        self._stream_keys: list[tuple[int, int]] = []
        self._block_ids = itertools.count(1)  # host block ids, shared by protected and arena memory
        self._block_ptrs: dict[int, int] = {}  # protected block -> its address
        self._copy_clocks: dict[int, tuple[int, ...]] = {}  # protected block -> join of its copies' clocks
        self._freed_clocks: dict[int, tuple[int, ...]] = {}  # address of a freed protected block -> same
        with real_cuda.device(device):
            self.gates = GatePool()
            self.watchdog = Watchdog(self.gates, self.timeout_s)
            self.arena = PinnedArena(lambda: next(self._block_ids))
            self.arena.grow()
            self._finalizer = weakref.finalize(self, _abandon, self.gates, self.watchdog, self._stream_keys)
            self._warm_up()
            super().__init__(device)

    @abstractmethod
    def _before_cuda_starts(self) -> None:
        """Called after the argument checks and before the first call that may create the CUDA
        context: a mode sets up its own state (the controlled runtime its model, and it asks for
        hardware queues here)."""

    def _warm_up(self) -> None:
        """Load the gate and sleep kernels now: loading one later, while gates spin, would wait for
        the GPU to drain (lazy loading, NVIDIA/nvbench#136), i.e. forever."""
        stream = spare_stream(self.device)
        gate = self.gates.acquire()
        self.gates.open(gate)
        self.gates.launch(gate, stream)
        with real_cuda.stream(stream):
            real_cuda._sleep(1)
            done = real_cuda.Event()
            done.record(stream)
        self._poll(done.query, "the warm-up of the gate kernel")
        self.gates.recycle(gate)

    # -- plumbing ----------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeUsageError("this cuda runtime is closed; create a new one with make_runtime('cuda')")
        if self._lost is not None:
            raise GateTimeoutError(
                f"this cuda runtime opened every gate after {self._lost} and no longer follows its "
                f"schedule; close() it and create a new one"
            )

    def _on(self, stream: Stream) -> contextlib.AbstractContextManager:
        # torch.cuda.stream also makes the stream's device current, and torch ops and Triton
        # launches issued inside go to the current stream.
        return real_cuda.stream(stream.handle)

    @contextlib.contextmanager
    def _guarded(self, what: str) -> Iterator[None]:
        """Run a host call that may wait for the GPU under the watchdog."""
        try:
            with self.watchdog.guard(what):
                yield
        except GateTimeoutError:
            self._lost = what
            raise

    def _poll(self, done: Callable[[], bool], what: str) -> None:
        """Wait until ``done()`` without ever blocking inside CUDA for longer than ``timeout_s``."""
        start = time.monotonic()
        while not done():
            waited = time.monotonic() - start
            if waited > self.timeout_s:
                self.gates.open_all()
                self._lost = what
                raise GateTimeoutError(
                    f"{what} did not finish within {self.timeout_s:g} s; every gate was opened so "
                    f"the GPU cannot hang, and this runtime no longer follows its schedule. Usual "
                    f"causes: more streams than CUDA_DEVICE_MAX_CONNECTIONS hardware queues (a "
                    f"stream sharing a queue with a gated one stalls behind its gate), work from "
                    f"outside the runtime queued on a gated stream, or an op that is just slow "
                    f"(raise timeout_s). close() this runtime and make a new one"
                )
            if waited > POLL_SPIN_S:
                unhooked_sleep(min(1e-3, waited / 10))

    # -- streams and events --------------------------------------------------------------------
    def _new_stream_handle(self, stream: Stream) -> object:
        self._check_usable()
        # Pool streams, never the legacy default stream: gating that would stall every blocking
        # stream in the process.
        handle, key = claim_stream(self.device)
        self._stream_keys.append(key)
        return handle

    def _use_stream_handle(self, stream: Stream) -> contextlib.AbstractContextManager:
        return real_cuda.stream(stream.handle)

    def _new_event_handle(self, event: Event) -> object:
        self._check_usable()
        return real_cuda.Event(enable_timing=event.timing)

    def _elapsed(self, start: Event, end: Event) -> float:
        return float(start.handle.elapsed_time(end.handle))  # type: ignore[attr-defined]

    # -- ops: a mode says how one reaches its stream (_submit) and what a sync needs first ------
    @abstractmethod
    def _submit(self, stream: Stream, kind: str, label: str, issue: Callable[[], None] | None = None,
                **fields: object) -> int:
        """Issue ``issue`` on ``stream`` as an op of ``kind`` (``fields`` are the model's
        :class:`~kvdevice.runtime.queues.QueuedOp` fields); return its position in the model (0 where
        the mode keeps none)."""

    @abstractmethod
    def _before_sync(self, what: str, stream: int | None = None, position: int | None = None) -> None:
        """What the host does before it waits for the device in ``what``: for one stream up to
        ``position`` (None: all of it), or for every stream (``stream`` None)."""

    def _record(self, event: Event, stream: Stream, stamp: OpStamp) -> None:
        self._check_usable()
        handle = event.handle

        def issue() -> None:
            handle.record(stream.handle)

        event.position = self._submit(stream, "record", stamp.label, issue)

    def _wait(self, event: Event, stream: Stream, stamp: OpStamp) -> None:
        self._check_usable()
        recorded = event.stream is not None  # CUDA treats a never-recorded event as complete
        handle = event.handle

        def issue() -> None:
            if recorded:
                stream.handle.wait_event(handle)

        # The controlled model opens this gate only once the awaited position has executed, so the
        # device never blocks on the wait itself.
        target = (event.stream.index, event.position) if recorded else None
        self._submit(stream, "wait", stamp.label, issue, wait_for=target)

    def _sync_event(self, event: Event) -> None:
        self._check_usable()
        what = f"synchronising {event!r}"
        self._before_sync(what, event.stream.index, event.position)
        self._poll(event.handle.query, what)

    def _sync_stream(self, stream: Stream) -> None:
        self._check_usable()
        what = f"synchronising stream '{stream.name}'"
        self._before_sync(what, stream.index)
        self._poll(stream.handle.query, what)

    def _sync_all(self) -> None:
        # Only this runtime's streams: torch.cuda.synchronize() would also wait for another
        # runtime's closed gates.
        self._check_usable()
        self._before_sync("synchronising every stream")
        for stream in self.streams:
            self._poll(stream.handle.query, f"synchronising stream '{stream.name}'")

    def _copy(self, action: Callable[[], None], src: HostBuffer, stream: Stream, stamp: OpStamp) -> None:
        self._check_usable()
        self._note_copy(src, stamp)
        self._submit(stream, "copy", stamp.label, action)

    def _launch(self, fn: Callable[[], None], stream: Stream, stamp: OpStamp) -> None:
        self._check_usable()
        self._submit(stream, "kernel", stamp.label, fn)

    # -- memory ------------------------------------------------------------------------------
    def _alloc_host(self, n: int, dtype: torch.dtype, protected: bool) -> HostBuffer:
        self._check_usable()
        if not protected:
            with self._guarded("allocating unprotected pinned memory"):
                slot, tensor = self.arena.alloc(n, dtype)
            return HostBuffer(slot, tensor, protected=False)
        with self._guarded("allocating pinned memory"):
            tensor = torch.empty(n, dtype=dtype, pin_memory=True)
        address = tensor.data_ptr()
        seen = self._freed_clocks.pop(address, None)
        if seen is not None:
            # PyTorch hands a block out again only after the events of its copies completed: the
            # allocator looked, so the host now knows those copies ran (as on the simulator).
            self.hb.host_observes(seen, self.host_thread())
        block = next(self._block_ids)  # fresh: PyTorch, not us, decides when memory is reused
        self._block_ptrs[block] = address
        return HostBuffer(block, tensor, protected=True)

    def _free_host(self, buf: HostBuffer) -> None:
        # Keep no reference to the memory: PyTorch frees a protected block when the last tensor
        # on it dies, and copies captured their own views.
        if not buf.protected:
            self.arena.free(buf.block)
            return
        if not self.checked:
            return
        address = self._block_ptrs.pop(buf.block, None)
        clock = self._copy_clocks.pop(buf.block, None)
        if address is not None and clock is not None:
            self._freed_clocks[address] = _join(self._freed_clocks.get(address), clock)

    def _note_copy(self, src: HostBuffer, stamp: OpStamp) -> None:
        """A copy of ``src`` was enqueued: join its clock into the block's, for ``_free_host``."""
        if src.protected and self.checked:
            self._copy_clocks[src.block] = _join(self._copy_clocks.get(src.block), stamp.vc)

    def device_buffer(self, n: int, dtype: torch.dtype = torch.int64, *, name: str | None = None) -> DeviceBuffer:
        self._check_usable()
        with self._guarded("allocating a device buffer"), real_cuda.device(self.device):
            return super().device_buffer(n, dtype, name=name)

    # -- teardown ----------------------------------------------------------------------------
    def _run_now(self, fn: Callable[[], None], stream: Stream, stamp: OpStamp) -> None:
        # The stream is idle (run_now synchronised it first), so fn is issued there with no gate
        # and may block the host (.item(), a blocking copy) without waiting behind one.
        self._check_usable()
        with self._guarded(stamp.label), self._on(stream):
            fn()
        self._poll(stream.handle.query, f"{stamp.label}: waiting for it to finish")

    def _stream_done(self, stream: Stream) -> bool:
        self._check_usable()
        return bool(stream.handle.query())

    def close(self) -> None:
        """Run every queued op, then open every gate and free the flags and arenas.

        The sync comes first, as on the simulator, so an unreleased hold still raises
        :class:`DeadlockError` here; the gates are opened whatever happens. Closing twice is a no-op.
        """
        if self._closed:
            return
        try:
            if self._lost is None:
                self.synchronize()
        finally:
            self._shut_down()

    def _shut_down(self) -> None:
        try:
            self._release_everything()
        finally:
            schedules.ended(self)

    def _release_everything(self) -> None:
        self._closed = True
        self.gates.open_all()
        deadline = time.monotonic() + self.timeout_s
        drained = False
        with contextlib.suppress(Exception):  # a sticky CUDA error must not stop the cleanup
            while not all(s.handle.query() for s in self.streams) and time.monotonic() < deadline:
                unhooked_sleep(1e-4)
            drained = all(s.handle.query() for s in self.streams)
        self._finalizer.detach()
        self.watchdog.stop()
        release_streams(self._stream_keys)
        if drained:
            self.gates.release()
        else:  # a gate kernel may still read its flag: keep the memory for the process's life
            abandon(self.gates)
        self.arena.release()
