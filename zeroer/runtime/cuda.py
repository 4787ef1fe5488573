"""The CUDA backend: real streams, events, pinned memory and copies on one GPU, in two modes.

``mode="free"`` (``scheduled = False``) issues every op straight to its stream and lets timing
decide; ``delay`` is ``torch.cuda._sleep``, which is how the vLLM #48085 overwrite was reproduced
on an H200. ``advance`` does nothing there.

``mode="controlled"`` (``scheduled = True``) makes the GPU take exactly the simulator's
scheduling decisions. The runtime keeps the simulator's model (:class:`StreamQueues`, one model
stream per stream, the same op kinds and labels; nothing runs until ``advance`` or a host sync
asks, like the simulator's lazy schedule). Every op is issued on its real stream when it is
enqueued, behind its own closed gate (:mod:`zeroer.runtime.gate`), and followed by a "done"
event. When the model executes an op, the host opens that op's gate and waits for its done event.
So an op has really run when the model says so, and nothing runs before: a copy reads its pinned
source at ``advance``, not at enqueue. Event queries answer from the model, which matches the
device because the model only moves while the host waits for it. Host syncs run the model's least
progress first (so a held stream raises :class:`DeadlockError` instead of hanging the GPU), then
the real sync, which is then immediate.

Memory. Protected host buffers are ``torch.empty(pin_memory=True)``: PyTorch's caching host
allocator records an event behind every non-blocking copy of a block and hands it out again only
after it (pytorch/pytorch#130785). Unprotected ones model pinned memory outside that allocator
(``cudaHostRegister``, ``from_blob``): :class:`PinnedArena` carves them from pinned arenas that
are never freed while the runtime lives, and reuses a freed slot at once, as the simulator does.

Rules while a controlled runtime has queued work (gates spin on the GPU):

* do not synchronise the device yourself (``torch.cuda.synchronize()``, ``.item()``, ``.cpu()``
  of gated data): use the runtime's ``synchronize*``, which open the gates they need first, or
  read on :func:`spare_stream` after ``advance``;
* launch every kernel once before gating it (inside :meth:`CudaRuntime.ungated`, or before any op
  is queued): a kernel's first launch loads its module, which waits for the GPU to drain
  (NVIDIA/nvbench#136); ``CUDA_MODULE_LOADING=EAGER`` does that up front for torch's kernels;
* use at most ``CUDA_DEVICE_MAX_CONNECTIONS`` streams (a stream that shares a hardware queue with
  a gated one stalls behind its gate).

``checked=False`` (free mode only) is for measuring a zeroer, not for finding races: no
happens-before checker, labels or annotations, no allocator clocks, no watchdog around calls
while no hold is placed, and no stream switch for an op on the stream that is already torch's
current one (``use_stream``). ``python -m fuzz.bench.kernel`` times each design both ways.

A host call stuck behind closed gates longer than ``timeout_s`` is turned into
:class:`~zeroer.runtime.gate.GateTimeoutError` after every gate has been opened: never a hang.

Example (needs a GPU)::

    from zeroer.runtime import make_runtime
    rt = make_runtime("cuda", mode="controlled")
    host, dev = rt.host_buffer(1), rt.device_buffer(1)
    rt.write_host(host, [1])
    rt.copy_h2d(dev, host)              # issued now, behind a closed gate
    rt.write_host(host, [2])            # the copy has not read host: a hazard is recorded
    rt.advance(rt.default_stream, 1)    # opens the gate: the copy reads [2]
    rt.synchronize()
    assert dev.tensor.tolist() == [2] and rt.hazards
    rt.close()
"""

from __future__ import annotations

import contextlib
import itertools
import time
import weakref
from collections.abc import Iterator
from typing import Callable

import torch

from zeroer.errors import DeadlockError, RuntimeUsageError
from zeroer.runtime.base import DeviceBuffer, Event, Hold, HostBuffer, Runtime, Stream
from zeroer.runtime.gate import (
    GatePool,
    GateTimeoutError,
    Watchdog,
    abandon,
    claim_stream,
    gate_available,
    hardware_queues,
    release_streams,
    spare_stream,
)
from zeroer.runtime.hb import OpStamp
from zeroer.runtime.queues import QueuedOp, StreamQueues
from zeroer.runtime.sim import SimHostAllocator

MODES = ("controlled", "free")
DELAY_CYCLES_PER_UNIT = 200_000  # torch.cuda._sleep cycles per delay unit: ~0.1 ms at ~2 GHz (H200)
DEFAULT_TIMEOUT_S = 30.0  # longest one gated op or one guarded host call may take before we give up
ARENA_BYTES = 1 << 22  # unprotected pinned memory is carved from 4 MiB arenas
ARENA_ALIGN = 64  # every arena slot starts on 64 bytes, enough for any dtype's view
POLL_SPIN_S = 2e-4  # busy-poll a done event this long (a gate opens in ~20 us), then back off
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what Triton uses too

def resolve_device(device: int | str | torch.device | None, count: int, current: int) -> torch.device:
    """``device`` as ``torch.device("cuda", index)``; ``None`` or ``"cuda"`` mean ``current``.

    ``count`` is ``torch.cuda.device_count()``; pure so that its messages are testable on CPU.
    """
    if count < 1:
        raise RuntimeUsageError(
            "backend 'cuda' needs a CUDA GPU and none is visible here; use backend 'sim' (or 'auto')"
        )
    valid = f"valid: 0..{count - 1}"
    if device is None:
        index = current
    elif isinstance(device, bool):
        raise RuntimeUsageError(f"device {device!r} is not a device; pass a cuda index ({valid}), 'cuda:N' or None")
    elif isinstance(device, int):
        index = device
    else:
        try:
            parsed = torch.device(device)
        except (RuntimeError, TypeError):
            raise RuntimeUsageError(
                f"device {device!r} is not a device; pass a cuda index ({valid}), 'cuda:N' or None"
            ) from None
        if parsed.type != "cuda":
            raise RuntimeUsageError(
                f"device {device!r} is not a cuda device; pass a cuda index ({valid}), 'cuda:N' or None, "
                f"or use backend 'sim' for CPU"
            )
        index = current if parsed.index is None else parsed.index
    if not 0 <= index < count:
        raise RuntimeUsageError(
            f"cuda device {index} does not exist: this machine has {count} ({valid}); "
            f"pass one of those or None for the current device"
        )
    return torch.device("cuda", index)


class PinnedArena:
    """Pinned memory outside PyTorch's caching host allocator, with immediate reuse.

    Slots come in power-of-two byte sizes (the simulator's size classes) and are carved from
    arenas that are never freed while the runtime lives; a freed slot goes on its size's free
    list and the next allocation of that size takes the newest one at once. Copies still reading
    it are not waited for: that is the ``cudaHostRegister`` / ``from_blob`` hazard, and the
    happens-before checker sees the reuse because the block id is the slot id.

    Example (``pin_memory=False`` runs anywhere)::

        ids = itertools.count(1)
        arena = PinnedArena(lambda: next(ids), pin_memory=False)
        a, _ = arena.alloc(4, torch.int64)
        arena.free(a)
        assert arena.alloc(3, torch.int64)[0] == a     # same 32-byte class, reused at once
    """

    def __init__(self, next_id: Callable[[], int], arena_bytes: int = ARENA_BYTES, *, pin_memory: bool = True) -> None:
        self._next_id = next_id
        self.arena_bytes = arena_bytes
        self.pin_memory = pin_memory
        self.arenas: list[torch.Tensor] = []
        self._top = 0  # bytes carved from the newest arena
        self._slots: dict[int, torch.Tensor] = {}  # slot id -> its bytes
        self._free: dict[int, list[int]] = {}  # size class -> free slot ids, newest last
        self.reused = 0

    def grow(self, size: int = 0) -> None:
        """Start a new arena of at least ``size`` bytes (the runtime makes the first one up front:
        a pinned allocation while gates spin might wait for the GPU)."""
        nbytes = max(self.arena_bytes, size)
        self.arenas.append(torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory))
        self._top = 0

    def _carve(self, size: int) -> int:
        offset = -(-self._top // ARENA_ALIGN) * ARENA_ALIGN
        if not self.arenas or offset + size > self.arenas[-1].numel():
            self.grow(size)
            offset = 0
        slot = self._next_id()
        self._slots[slot] = self.arenas[-1][offset : offset + size]
        self._top = offset + size
        return slot

    def alloc(self, n: int, dtype: torch.dtype) -> tuple[int, torch.Tensor]:
        """A slot for ``n`` elements of ``dtype``: (slot id, tensor view of exactly n elements)."""
        nbytes = n * torch.empty(0, dtype=dtype).element_size()
        size = SimHostAllocator._size_class(nbytes)
        free = self._free.get(size)
        if free:
            slot = free.pop()
            self.reused += 1
        else:
            slot = self._carve(size)
        return slot, self._slots[slot][:nbytes].view(dtype)

    def free(self, slot: int) -> None:
        self._free.setdefault(self._slots[slot].numel(), []).append(slot)

    def release(self) -> None:
        """Drop every arena. PyTorch keeps one alive while a copy from it is pending."""
        self.arenas, self._slots, self._free = [], {}, {}


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


class CudaRuntime(Runtime):
    """The cuda backend. See the module docstring for the two modes."""

    backend = "cuda"

    def __init__(
        self,
        mode: str = "controlled",
        device: int | str | torch.device | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        checked: bool = True,
    ) -> None:
        if mode not in MODES:
            raise RuntimeUsageError(f"unknown cuda mode {mode!r}; choose one of {', '.join(MODES)}")
        if not isinstance(checked, bool):
            raise RuntimeUsageError(f"checked={checked!r}: pass True (the default) or False")
        if not checked and mode != "free":
            raise RuntimeUsageError(
                f"checked=False needs mode='free': the {mode} mode's schedule is built on the "
                f"bookkeeping that checked=False skips; use CudaRuntime(mode='free', checked=False)"
            )
        if not torch.cuda.is_available():
            raise RuntimeUsageError(
                "backend 'cuda' needs a CUDA GPU and torch.cuda.is_available() is False here; "
                "use backend 'sim' (or 'auto')"
            )
        if not gate_available():
            raise RuntimeUsageError("the cuda backend needs triton for its gate kernel; install triton or use backend 'sim'")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise RuntimeUsageError(f"timeout_s {timeout_s!r} must be a positive number of seconds")
        device = resolve_device(device, torch.cuda.device_count(), torch.cuda.current_device())
        # Base __init__ creates the "main" stream through our hooks, so everything they use is set
        # up first (as SimRuntime does with its queues).
        self.device = device
        self.mode = mode
        self.scheduled = mode == "controlled"
        self.checked = checked  # read by Runtime.__init__
        self.timeout_s = float(timeout_s)
        self.queues: StreamQueues | None = StreamQueues(execute=self._execute) if self.scheduled else None
        self.max_streams = hardware_queues() if self.scheduled else None
        self._closed = False
        self._ungated = False  # inside ungated(): ops run at once, with no gate
        self._lost: str | None = None  # why this runtime stopped following its schedule
        self._held: list[Hold] = []  # unreleased holds (free mode)
        self._stream_keys: list[tuple[int, int]] = []
        self._block_ids = itertools.count(1)  # host block ids, shared by protected and arena memory
        self._block_ptrs: dict[int, int] = {}  # protected block -> its address
        self._copy_clocks: dict[int, tuple[int, ...]] = {}  # protected block -> join of its copies' clocks
        self._freed_clocks: dict[int, tuple[int, ...]] = {}  # address of a freed protected block -> same
        with torch.cuda.device(device):
            self.gates = GatePool()
            self.watchdog = Watchdog(self.gates, self.timeout_s)
            self.arena = PinnedArena(lambda: next(self._block_ids))
            self.arena.grow()
            self._finalizer = weakref.finalize(self, _abandon, self.gates, self.watchdog, self._stream_keys)
            self._warm_up()
        super().__init__(device)

    def _warm_up(self) -> None:
        """Load the gate and sleep kernels now: loading one later, while gates spin, would wait for
        the GPU to drain (lazy loading, NVIDIA/nvbench#136), i.e. forever."""
        stream = spare_stream(self.device)
        gate = self.gates.acquire()
        self.gates.open(gate)
        self.gates.launch(gate, stream)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(1)
            done = torch.cuda.Event()
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
        return torch.cuda.stream(stream.handle)

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
                time.sleep(min(1e-3, waited / 10))

    def _enqueue(self, stream: Stream, op: QueuedOp, issue: Callable[[], None] | None = None) -> int:
        """Controlled mode: issue ``op`` behind a fresh closed gate and queue it in the model."""
        if self._ungated:
            return self._run_ungated(stream, op, issue)
        with self._guarded(op.label), self._on(stream):
            gate = self.gates.acquire()
            self.gates.launch(gate, stream.handle)
            try:
                if issue is not None:
                    issue()
            except BaseException as exc:
                # The op never reaches the model, so nothing would open its gate: open it now;
                # whatever it issued runs in stream order.
                self.gates.open(gate)
                with contextlib.suppress(Exception):
                    marker = torch.cuda.Event()
                    marker.record(stream.handle)
                    self.gates.retire(gate, marker)
                exc.add_note(f"{op.label} was not queued; its gate was opened")
                raise
            done = torch.cuda.Event()
            done.record(stream.handle)
        op.payload["gate"], op.payload["done"] = gate, done
        return self.queues.enqueue(stream.index, op)

    def _run_ungated(self, stream: Stream, op: QueuedOp, issue: Callable[[], None] | None) -> int:
        """Inside :meth:`ungated`: issue ``op`` with no gate and let the model execute it at once."""
        if op.kind == "hold":
            raise RuntimeUsageError(
                f"{op.label}: a hold inside ungated() could never stop anything; place it outside"
            )
        with self._guarded(op.label), self._on(stream):
            if issue is not None:
                issue()
            done = torch.cuda.Event()
            done.record(stream.handle)
        op.payload["gate"], op.payload["done"] = None, done
        position = self.queues.enqueue(stream.index, op)
        # Every stream was idle on entry and each op runs at once, so nothing can block this one.
        self.queues.advance(stream.index, op.remaining)
        return position

    @contextlib.contextmanager
    def ungated(self) -> Iterator[None]:
        """Run every op enqueued inside at once and without a gate, as if advanced right away.

        For warm-ups: the first launch of a kernel loads its module, which waits for the GPU to
        drain and so never returns while a gate spins (NVIDIA/nvbench#136). Needs an idle
        runtime; a no-op wrapper in free mode, where nothing is gated but holds.

        Example::

            with rt.ungated():
                zeroer.warmup()        # compiles and loads the zero kernel
        """
        self._check_usable()
        if self.queues is None:
            yield
            return
        busy = [f"'{s.name}' ({self.queues.pending(s.index)})" for s in self.streams if self.queues.pending(s.index)]
        if busy:
            raise RuntimeUsageError(
                f"ungated() needs an idle runtime, but ops are queued on stream(s) {', '.join(busy)}; "
                f"call synchronize() first"
            )
        self._ungated = True
        try:
            yield
        finally:
            self._ungated = False

    def _issue(self, stream: Stream, what: str, issue: Callable[[], None]) -> None:
        """Free mode: issue the work on ``stream`` now."""
        if self._fast():
            if self._is_torch_current(stream):
                issue()
            else:
                with self._on(stream):
                    issue()
            return
        with self._guarded(what), self._on(stream):
            issue()

    def _fast(self) -> bool:
        """Unchecked and nothing held: no gate can spin, so host calls need no watchdog."""
        return not self.checked and not self._held

    def _is_torch_current(self, stream: Stream) -> bool:
        # Two C calls (~0.3 us) instead of entering torch.cuda.stream (several us).
        return (
            _current_raw_stream is not None
            and torch.cuda.current_device() == self.device.index
            and _current_raw_stream(self.device.index) == stream.handle.cuda_stream
        )

    def _execute(self, op: QueuedOp) -> None:
        """The model runs ``op``: open its gate and wait until the GPU has run it."""
        gate, done = op.payload["gate"], op.payload["done"]
        if gate is not None:
            self.gates.open(gate)
        self._poll(done.query, op.label)
        if gate is not None:
            self.gates.recycle(gate)

    def _new_stream_handle(self, stream: Stream) -> object:
        self._check_usable()
        if self.max_streams is not None and stream.index >= self.max_streams:
            raise RuntimeUsageError(
                f"stream {stream.name!r} would be stream {stream.index + 1} of a controlled runtime, "
                f"over the {self.max_streams} hardware queues (CUDA_DEVICE_MAX_CONNECTIONS) that "
                f"streams share: a stream sharing a queue with a gated one stalls behind its gate. "
                f"Use at most {self.max_streams} streams, or set CUDA_DEVICE_MAX_CONNECTIONS=32 "
                f"before CUDA initialises"
            )
        # Pool streams, never the legacy default stream: gating that would stall every blocking
        # stream in the process.
        handle, key = claim_stream(self.device)
        self._stream_keys.append(key)
        if self.queues is not None:
            self.queues.add_stream(stream.name)
        return handle

    def _use_stream_handle(self, stream: Stream) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream.handle)

    def pending(self, stream: Stream) -> int:
        return self.queues.pending(stream.index) if self.queues is not None else 0

    # -- events ------------------------------------------------------------------------------
    def _new_event_handle(self, event: Event) -> object:
        self._check_usable()
        return torch.cuda.Event()

    def _record(self, event: Event, stream: Stream, stamp: OpStamp) -> None:
        self._check_usable()
        handle = event.handle

        def issue() -> None:
            handle.record(stream.handle)

        if self.queues is not None:
            event.position = self._enqueue(stream, QueuedOp("record", stamp.label), issue)
        else:
            self._issue(stream, stamp.label, issue)

    def _wait(self, event: Event, stream: Stream, stamp: OpStamp) -> None:
        self._check_usable()
        recorded = event.stream is not None  # CUDA treats a never-recorded event as complete
        handle = event.handle

        def issue() -> None:
            if recorded:
                stream.handle.wait_event(handle)

        if self.queues is not None:
            # The model opens this gate only once the awaited position has executed, so the
            # device never blocks on the wait itself.
            target = (event.stream.index, event.position) if recorded else None
            self._enqueue(stream, QueuedOp("wait", stamp.label, wait_for=target), issue)
        else:
            self._issue(stream, stamp.label, issue)

    def _event_done(self, event: Event) -> bool:
        self._check_usable()
        if self.queues is not None:
            return self.queues.completed(event.stream.index, event.position)
        return bool(event.handle.query())

    def _check_no_holds(self, what: str) -> None:
        """Free mode: a sync behind a shut gate would hang the host, and we cannot tell which
        work the sync needs, so any unreleased hold makes every sync a deadlock."""
        if self._held:
            held = ", ".join(h.label for h in self._held)  # labels name their streams
            raise DeadlockError(
                f"deadlock: {what} would wait forever behind {held}; "
                f"a free-running runtime cannot tell which work a sync needs, so call release() "
                f"on every hold before synchronising"
            )

    def _sync_event(self, event: Event) -> None:
        self._check_usable()
        if self.queues is not None:
            self.queues.run_until(event.stream.index, event.position)
        else:
            self._check_no_holds(f"synchronising {event!r}")
        self._poll(event.handle.query, f"synchronising {event!r}")

    def _sync_stream(self, stream: Stream) -> None:
        self._check_usable()
        if self.queues is not None:
            self.queues.drain(stream.index)
        else:
            self._check_no_holds(f"synchronising stream '{stream.name}'")
        self._poll(stream.handle.query, f"synchronising stream '{stream.name}'")

    def _sync_all(self) -> None:
        # Only this runtime's streams: torch.cuda.synchronize() would also wait for another
        # runtime's closed gates.
        self._check_usable()
        if self.queues is not None:
            self.queues.drain_all()
        else:
            self._check_no_holds("synchronising every stream")
        for stream in self.streams:
            self._poll(stream.handle.query, f"synchronising stream '{stream.name}'")

    # -- memory ------------------------------------------------------------------------------
    def _alloc_host(self, n: int, dtype: torch.dtype, protected: bool) -> HostBuffer:
        self._check_usable()
        if not protected:
            with self._guarded("allocating unprotected pinned memory"):
                slot, tensor = self.arena.alloc(n, dtype)
            return HostBuffer(slot, tensor, protected=False)
        if self._fast():  # no allocator clocks: nothing reads them
            return HostBuffer(next(self._block_ids), torch.empty(n, dtype=dtype, pin_memory=True), protected=True)
        with self._guarded("allocating pinned memory"):
            tensor = torch.empty(n, dtype=dtype, pin_memory=True)
        address = tensor.data_ptr()
        seen = self._freed_clocks.pop(address, None)
        if seen is not None:
            # PyTorch hands a block out again only after the events of its copies completed: the
            # allocator looked, so the host now knows those copies ran (as on the simulator).
            self.hb.host_observes(seen)
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

    def device_buffer(self, n: int, dtype: torch.dtype = torch.int64, *, name: str | None = None) -> DeviceBuffer:
        self._check_usable()
        if self._fast():
            with torch.cuda.device(self.device):
                return super().device_buffer(n, dtype, name=name)
        with self._guarded("allocating a device buffer"), torch.cuda.device(self.device):
            return super().device_buffer(n, dtype, name=name)

    # -- work --------------------------------------------------------------------------------
    def _copy(self, action: Callable[[], None], src: HostBuffer, stream: Stream, stamp: OpStamp) -> None:
        self._check_usable()
        if src.protected and self.checked:
            self._copy_clocks[src.block] = _join(self._copy_clocks.get(src.block), stamp.vc)
        if self.queues is not None:
            self._enqueue(stream, QueuedOp("copy", stamp.label), action)
        else:
            self._issue(stream, stamp.label, action)

    def _launch(self, fn: Callable[[], None], stream: Stream, stamp: OpStamp) -> None:
        self._check_usable()
        if self.queues is not None:
            self._enqueue(stream, QueuedOp("kernel", stamp.label), fn)
        else:
            self._issue(stream, stamp.label, fn)

    def _delay(self, stream: Stream, amount: int, stamp: OpStamp) -> None:
        self._check_usable()
        if self.queues is not None:
            # The model makes the stream take ``amount`` steps; the gate alone enforces that.
            self._enqueue(stream, QueuedOp("sleep", stamp.label, remaining=amount))
        else:
            self._issue(stream, stamp.label, lambda: torch.cuda._sleep(amount * DELAY_CYCLES_PER_UNIT))

    def _hold(self, hold: Hold, stamp: OpStamp) -> None:
        self._check_usable()
        if self.queues is not None:
            # Its gate opens once the host released the hold AND the model runs it.
            op = QueuedOp("hold", stamp.label)
            hold.payload["op"] = op
            self._enqueue(hold.stream, op)
            return
        with self._guarded(stamp.label), self._on(hold.stream):
            gate = self.gates.acquire()
            self.gates.launch(gate, hold.stream.handle)
            done = torch.cuda.Event()
            done.record(hold.stream.handle)
        hold.payload["gate"], hold.payload["done"] = gate, done
        self._held.append(hold)

    def _release(self, hold: Hold) -> None:
        self._check_usable()
        if self.queues is not None:
            self.queues.release(hold.payload["op"])
            return
        self.gates.open(hold.payload["gate"])
        self.gates.retire(hold.payload["gate"], hold.payload["done"])
        self._held = [h for h in self._held if h is not hold]

    def _advance(self, stream: Stream, ops: int) -> int:
        self._check_usable()
        if self.queues is None:
            return 0
        return self.queues.advance(stream.index, ops)

    # -- teardown ----------------------------------------------------------------------------
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
        self._closed = True
        self.gates.open_all()
        deadline = time.monotonic() + self.timeout_s
        drained = False
        with contextlib.suppress(Exception):  # a sticky CUDA error must not stop the cleanup
            while not all(s.handle.query() for s in self.streams) and time.monotonic() < deadline:
                time.sleep(1e-4)
            drained = all(s.handle.query() for s in self.streams)
        self._finalizer.detach()
        self.watchdog.stop()
        release_streams(self._stream_keys)
        if drained:
            self.gates.release()
        else:  # a gate kernel may still read its flag: keep the memory for the process's life
            abandon(self.gates)
        self.arena.release()
