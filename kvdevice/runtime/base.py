"""The stream runtime interface every zeroer is written against.

A zeroer needs a handful of things from CUDA: streams and events, pinned host buffers,
non-blocking host-to-device copies, kernel launches and host synchronisation. :class:`Runtime`
offers exactly those, so one zeroer source runs on a real GPU (``cuda`` backend) and on a
deterministic CPU simulator (``sim`` backend) that CI can use.

The base class does the bookkeeping that is the same on every backend: names and labels, argument
checks, and the happens-before checker (:mod:`racecheck.hb`), which sees every operation at
enqueue time. Backends implement the ``_`` hooks: how an op is enqueued and executed, what an
event's completion means, where memory comes from.

A runtime whose ``checked`` is False (``CudaRuntime(mode="free", checked=False)``) skips the
checker, op labels and annotations: the very same zeroer code then runs with little more than
its own CUDA calls, which is what ``python -m fuzz.bench.kernel`` times as a design's cost. Nothing is
checked there, so it is never used for fuzzing.

Example (works the same with ``make_runtime("cuda")`` on a GPU)::

    from kvdevice.runtime import make_runtime
    rt = make_runtime("sim")
    side = rt.new_stream("side")
    host = rt.host_buffer(4)
    dev = rt.device_buffer(4)
    rt.write_host(host, [1, 2, 3, 4])
    rt.copy_h2d(dev, host)             # queued on the current stream, reads host when it runs
    done = rt.record_event()
    rt.wait_event(done, stream=side)   # side's later work sees the copy
    rt.synchronize()
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Callable

import torch

from racecheck.errors import RuntimeUsageError
from kvdevice.runtime.cuda_errors import (NO_TIMING, NOT_COMPLETED, NOT_RECORDED, CudaStateRuntimeError,
                                          CudaStateValueError, events_in_state)
from kvdevice.runtime.op_origin import OpOrigin
from racecheck.clocks import HOST
from racecheck.hb import HappensBefore, Hazard, OpStamp
from racecheck.threads import HostThreads

# What an unchecked runtime hands its backend instead of a real stamp: no clock, a fixed label.
UNCHECKED_STAMP = OpStamp(0, 0, (), "an op of an unchecked runtime (no labels)")
_NO_CONTEXT = contextlib.nullcontext()  # stateless, so one serves every call (annotations, stream scopes)
_NO_ORIGIN = OpOrigin(None, None)  # outside every annotation: nobody said whose an op is


def _nothing(*args: object, **kwargs: object) -> None:
    return None


class _NoHappensBefore:
    """Stands in for :class:`HappensBefore` in an unchecked runtime: records nothing, finds nothing."""

    def __init__(self) -> None:
        self.hazards: list[Hazard] = []
        self._threads = 0

    def add_stream(self, name: str, parent: int | None = HOST) -> int:
        self._threads += 1
        return self._threads

    add_host = add_stream  # a host thread is one more clock index, as a stream is

    def enqueue(self, thread: int, label: str, host: int = HOST) -> OpStamp:
        return UNCHECKED_STAMP

    def snapshot(self, thread: int) -> tuple[int, ...]:
        return ()

    def pending_writes(self, *args: object, **kwargs: object) -> list[OpStamp]:
        return []

    stream_waits = host_observes = host_observes_stream = host_observes_all = staticmethod(_nothing)
    name_resource = copy_reads_host = copy_writes_host = host_write = host_read = staticmethod(_nothing)
    device_access = host_acquires = forget = staticmethod(_nothing)


@dataclass(eq=False)
class Stream:
    """A stream handle. ``index`` is its position in ``Runtime.streams``."""

    index: int
    name: str
    thread: int  # happens-before thread index
    handle: object = None  # backend object (torch.cuda.Stream on cuda)

    def __repr__(self) -> str:
        return f"Stream({self.name!r})"


@dataclass(eq=False)
class Event:
    """An event handle. Unrecorded events count as complete, as in CUDA."""

    index: int
    stream: Stream | None = None  # where it was last recorded
    position: int = 0  # op position on that stream (queue-model backends)
    hb_snapshot: tuple[int, ...] | None = None
    handle: object = None  # backend object (torch.cuda.Event on cuda)
    timing: bool = False  # made with enable_timing=True: elapsed_time() may read it
    time: int | None = None  # the simulator's step count when its latest record ran (sim only)

    def __repr__(self) -> str:
        where = f" on {self.stream.name!r}" if self.stream is not None else " (never recorded)"
        return f"Event(#{self.index}{where})"


@dataclass(eq=False)
class HostBuffer:
    """Host ("pinned") memory a non-blocking copy can read.

    ``protected`` buffers come from the caching host allocator, which (like PyTorch's) does not
    hand a freed block out again until the events recorded on it have completed. Unprotected
    buffers model pinned memory from outside that allocator (``cudaHostRegister``,
    ``torch.from_blob``): freed memory is reused at once, whatever copy may still read it.
    """

    block: int  # allocator block id; the happens-before key
    tensor: torch.Tensor  # CPU tensor (pinned on cuda)
    protected: bool
    freed: bool = False

    @property
    def key(self) -> tuple:
        return ("host", self.block)

    def __len__(self) -> int:
        return self.tensor.numel()


@dataclass(eq=False)
class DeviceBuffer:
    """Device memory (a CPU tensor on the simulator)."""

    id: int
    tensor: torch.Tensor

    @property
    def key(self) -> tuple:
        return ("dev", self.id)

    def __len__(self) -> int:
        return self.tensor.numel()


@dataclass(eq=False)
class Hold:
    """A hold placed on a stream: the stream stops there until the host releases it."""

    stream: Stream
    label: str
    released: bool = False
    payload: dict = field(default_factory=dict)


class _Annotation:
    """``Runtime.annotate``'s context: a plain class, as it wraps every zero call and fuzzer op
    (a ``contextlib.contextmanager`` generator costs several times more to enter and leave)."""

    __slots__ = ("_stack", "_call", "_owner")

    def __init__(self, stack: list[OpOrigin], call: str | None, owner: str | None) -> None:
        self._stack, self._call, self._owner = stack, call, owner

    def __enter__(self) -> None:
        stack = self._stack
        # What the annotation does not say it inherits: code annotating its own calls stays the
        # owner its caller named, and a caller naming the owner keeps the label's call.
        outer = stack[-1] if stack else _NO_ORIGIN
        stack.append(OpOrigin(self._owner or outer.owner, self._call if self._call is not None else outer.call))

    def __exit__(self, *exc: object) -> None:
        self._stack.pop()


class _BlockSpace:
    """``Runtime.block_space``'s context."""

    __slots__ = ("_rt", "_index", "_previous")

    def __init__(self, rt: "Runtime", index: int) -> None:
        self._rt, self._index = rt, index

    def __enter__(self) -> None:
        self._previous, self._rt._block_space = self._rt._block_space, self._index

    def __exit__(self, *exc: object) -> None:
        self._rt._block_space = self._previous


class _StreamScope:
    """``Runtime.use_stream``'s context (a plain class for the same reason as :class:`_Annotation`)."""

    __slots__ = ("_rt", "_stream", "_previous", "_handle")

    def __init__(self, rt: "Runtime", stream: Stream) -> None:
        self._rt, self._stream = rt, stream

    def __enter__(self) -> Stream:
        rt = self._rt
        self._previous, rt._current = rt._current, self._stream
        try:
            self._handle = rt._use_stream_handle(self._stream)
            self._handle.__enter__()
        except BaseException:
            rt._current = self._previous
            raise
        return self._stream

    def __exit__(self, *exc: object) -> bool | None:
        try:
            return self._handle.__exit__(*exc)
        finally:
            self._rt._current = self._previous


class Runtime(ABC):
    """Streams, events, host buffers, copies, launches and synchronisation on one device."""

    backend: str = "?"
    #: whether ``advance`` decides what runs (sim, controlled cuda) or timing does (free cuda)
    scheduled: bool = True
    #: False: no happens-before checking, labels or annotations (the module docstring says when)
    checked: bool = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.hb = HappensBefore() if self.checked else _NoHappensBefore()
        self.streams: list[Stream] = []
        self._op_ids = itertools.count(1)
        # What an op's label is made of its text: a str here; a tool may hand back a str subclass that
        # carries what its reports say of the op (the sanitizer's Label), which lives as long as the label.
        self.labels: Callable[[str], str] = str
        self._event_ids = itertools.count(1)
        self._buffer_ids = itertools.count(1)
        self._origin: list[OpOrigin] = []  # the annotations entered, innermost last
        self._block_space = 0  # which KV cache "block N" means (block_space)
        self._local = threading.local()  # each Python thread's current stream, as CUDA keeps one per thread
        self.threads = HostThreads(self.hb)
        self.default_stream = self.new_stream("main")

    # -- host threads and their current streams --------------------------------------------------
    @property
    def _current(self) -> Stream:
        return getattr(self._local, "stream", None) or self.default_stream

    @_current.setter
    def _current(self, stream: Stream) -> None:
        self._local.stream = stream

    def host_thread(self) -> int:
        """The happens-before index of the Python thread calling (:mod:`racecheck.threads`)."""
        return self.threads.current()

    # -- labels ------------------------------------------------------------------------------
    def annotate(self, call: str | None = None, *, owner: str | None = None) -> contextlib.AbstractContextManager[None]:
        """Tag every op enqueued inside with the ``call`` it belongs to (e.g. ``"zero_block_ids#3"``,
        shown in its label) and the ``owner`` whose code queued it (``"zeroer"``, ``"offloader"``,
        :data:`~kvdevice.runtime.op_origin.HARNESS`: :mod:`kvdevice.runtime.op_origin`). What is
        not given is the enclosing annotation's."""
        return _Annotation(self._origin, call, owner) if self.checked else _NO_CONTEXT

    @property
    def origin(self) -> OpOrigin:
        """The origin an op enqueued now gets (:meth:`annotate`)."""
        return self._origin[-1] if self._origin else _NO_ORIGIN

    def _label(self, what: str, stream: Stream | None = None) -> str:
        if not self.checked:
            return what
        label = f"{what}#{next(self._op_ids)}"
        if stream is not None:
            label += f" on stream '{stream.name}'"
        call = self._origin[-1].call if self._origin else None
        if call is not None:
            label += f" ({call})"
        return self.labels(label)

    def block_space(self, index: int) -> contextlib.AbstractContextManager[None]:
        """Inside, the KV-cache blocks that :meth:`launch` declares are those of cache ``index``
        (a process may hold several caches, one zeroer each: block 3 of one is not block 3 of
        another)."""
        return _BlockSpace(self, index)

    @property
    def hazards(self) -> list[Hazard]:
        return self.hb.hazards

    # -- streams -----------------------------------------------------------------------------
    def new_stream(self, name: str | None = None) -> Stream:
        index = len(self.streams)
        name = name or f"stream{index}"
        if any(s.name == name for s in self.streams):
            raise RuntimeUsageError(
                f"stream name {name!r} is already taken by stream {self.stream_index(name)}; "
                f"choose another name"
            )
        stream = Stream(index, name, self.hb.add_stream(name))
        stream.handle = self._new_stream_handle(stream)
        self.streams.append(stream)
        return stream

    def stream_index(self, name: str) -> int:
        for stream in self.streams:
            if stream.name == name:
                return stream.index
        raise RuntimeUsageError(f"no stream named {name!r}; streams: {[s.name for s in self.streams]}")

    def stream(self, which: int | str) -> Stream:
        """A stream by index or name."""
        if isinstance(which, str):
            return self.streams[self.stream_index(which)]
        if not 0 <= which < len(self.streams):
            raise RuntimeUsageError(
                f"stream {which} does not exist: this runtime has {len(self.streams)} streams "
                f"(valid: 0..{len(self.streams) - 1}); create more with new_stream()"
            )
        return self.streams[which]

    def current_stream(self) -> Stream:
        return self._current

    def use_stream(self, stream: Stream) -> contextlib.AbstractContextManager[Stream]:
        """Make ``stream`` current inside the block, like ``torch.cuda.stream``."""
        self._check_stream(stream)
        return _StreamScope(self, stream)

    def _resolve(self, stream: Stream | None) -> Stream:
        if stream is None:
            return self._current
        self._check_stream(stream)
        return stream

    def _check_stream(self, stream: Stream) -> None:
        if not isinstance(stream, Stream) or stream.index >= len(self.streams) or (
            self.streams[stream.index] is not stream
        ):
            raise RuntimeUsageError(
                f"{stream!r} is not a stream of this {self.backend} runtime; "
                f"use one returned by its new_stream() or stream()"
            )

    # -- events ------------------------------------------------------------------------------
    def new_event(self, timing: bool = False) -> Event:
        """A new event; ``timing``: it keeps a time stamp, as ``torch.cuda.Event(enable_timing=True)``."""
        event = Event(next(self._event_ids), timing=timing)
        event.handle = self._new_event_handle(event)
        return event

    def record_event(self, event: Event | None = None, stream: Stream | None = None) -> Event:
        """Record ``event`` (a new one if None) at the current end of ``stream``."""
        stream = self._resolve(stream)
        event = event or self.new_event()
        stamp = self.hb.enqueue(stream.thread, self._label("record", stream), self.host_thread())
        event.stream = stream
        event.hb_snapshot = stamp.vc
        self._record(event, stream, stamp)
        return event

    def wait_event(self, event: Event, stream: Stream | None = None) -> None:
        """Make later work on ``stream`` wait until ``event``'s recorded position has executed."""
        stream = self._resolve(stream)
        stamp = self.hb.enqueue(stream.thread, self._label("wait", stream), self.host_thread())
        self.hb.stream_waits(stream.thread, event.hb_snapshot)
        self._wait(event, stream, stamp)

    def query_event(self, event: Event) -> bool:
        """True when ``event`` has completed; the host then knows everything before it ran."""
        done = event.stream is None or self._event_done(event)
        if done:
            self.hb.host_observes(event.hb_snapshot, self.host_thread())
        return done

    def elapsed_time(self, start: Event, end: Event) -> float:
        """Milliseconds from ``start`` to ``end``, as ``torch.cuda.Event.elapsed_time``: both made
        with timing, recorded, and complete (the host then knows everything before them, as after a
        query), else what torch raises, in its order of checks and with its type and words
        (:mod:`kvdevice.runtime.cuda_errors`), on both backends: the runtime's model says whether an
        event has completed, which on a controlled GPU is not the device's own view. Real on CUDA;
        on the simulator its clock (:data:`kvdevice.runtime.sim.SIM_MS_PER_STEP` per scheduling step)."""
        if not (start.timing and end.timing):
            state = events_in_state(not start.timing, not end.timing, "made without enable_timing=True",
                                    "made without enable_timing=True")
            raise CudaStateValueError("Both events must be created with argument 'enable_timing=True'.",
                                      call="elapsed_time", state=state, reason=NO_TIMING)
        if start.stream is None or end.stream is None:
            state = events_in_state(start.stream is None, end.stream is None, "that was never recorded",
                                    "that were never recorded")
            raise CudaStateValueError("Both events must be recorded before calculating elapsed time.",
                                      call="elapsed_time", state=state, reason=NOT_RECORDED)
        # torch queries the end event only once the start has completed (query() && other.query())
        if not (self.query_event(start) and self.query_event(end)):
            # Named by the end event whenever it has not completed, whatever the start's state (which
            # the copies' own synchronisation decides): timing a job claims that its end has completed.
            end_done = self._event_done(end)
            state = events_in_state(end_done, not end_done, "that had not completed", "that had not completed")
            raise CudaStateRuntimeError("Both events must be completed before calculating elapsed time.",
                                        call="elapsed_time", state=state, reason=NOT_COMPLETED)
        return self._elapsed(start, end)

    def synchronize_event(self, event: Event) -> None:
        if event.stream is not None:
            self._sync_event(event)
        self.hb.host_observes(event.hb_snapshot, self.host_thread())

    def synchronize_stream(self, stream: Stream | None = None) -> None:
        stream = self._resolve(stream)
        self._sync_stream(stream)
        self.hb.host_observes_stream(stream.thread, self.host_thread())

    def synchronize(self) -> None:
        """Wait for all work on every stream (``torch.cuda.synchronize``)."""
        self._sync_all()
        self.hb.host_observes_all(self.host_thread())

    # -- memory ------------------------------------------------------------------------------
    def host_buffer(self, n: int, dtype: torch.dtype = torch.int64, *, protected: bool = True) -> HostBuffer:
        """Pinned host memory for ``n`` elements; see :class:`HostBuffer` for ``protected``."""
        if not isinstance(n, int) or n < 1:
            raise RuntimeUsageError(f"host buffer size {n!r} must be a positive int")
        buf = self._alloc_host(n, dtype, protected)
        self.hb.name_resource(buf.key, f"pinned host buffer {buf.block}")
        return buf

    def free_host(self, buf: HostBuffer) -> None:
        """Give ``buf`` back; a protected block is reused only after its copies completed."""
        if buf.freed:
            raise RuntimeUsageError(f"pinned host buffer {buf.block} was already freed")
        buf.freed = True
        self._free_host(buf)

    def write_host(self, buf: HostBuffer, values: Sequence[int] | torch.Tensor, offset: int = 0) -> None:
        """Write ``values`` into ``buf`` on the host, now (checked against pending copies)."""
        if buf.freed:
            raise RuntimeUsageError(f"pinned host buffer {buf.block} is freed; allocate a new one")
        data = torch.as_tensor(values, dtype=buf.tensor.dtype)
        if offset < 0 or offset + data.numel() > buf.tensor.numel():
            raise RuntimeUsageError(
                f"writing {data.numel()} values at offset {offset} overflows pinned host buffer "
                f"{buf.block} of {buf.tensor.numel()} elements"
            )
        call = self.origin.call
        self.hb.host_write(buf.key, self._label("host-write") if call is None else call,
                           self.host_thread())
        buf.tensor[offset : offset + data.numel()] = data

    def device_buffer(self, n: int, dtype: torch.dtype = torch.int64, *, name: str | None = None) -> DeviceBuffer:
        if not isinstance(n, int) or n < 1:
            raise RuntimeUsageError(f"device buffer size {n!r} must be a positive int")
        buf = DeviceBuffer(next(self._buffer_ids), torch.empty(n, dtype=dtype, device=self.device))
        self.hb.name_resource(buf.key, f"device buffer {buf.id}" + (f" ({name})" if name else ""))
        return buf

    # -- work --------------------------------------------------------------------------------
    def copy_h2d(
        self, dst: DeviceBuffer, src: HostBuffer, n: int | None = None, *, stream: Stream | None = None
    ) -> None:
        """Enqueue a non-blocking copy of ``src[:n]`` into ``dst[:n]``.

        The copy reads ``src`` when the stream executes it, not now: rewriting ``src`` before then
        changes what arrives (vLLM #48085).
        """
        stream = self._resolve(stream)
        n = len(src) if n is None else n
        if src.freed:
            raise RuntimeUsageError(f"pinned host buffer {src.block} is freed; copy from a live buffer")
        if not 0 < n <= min(len(src), len(dst)):
            raise RuntimeUsageError(
                f"copy of {n} elements does not fit: source has {len(src)}, destination {len(dst)}"
            )
        stamp = self.hb.enqueue(stream.thread, self._label("copy", stream), self.host_thread())
        self.hb.copy_reads_host(src.key, stamp)
        self.hb.device_access(dst.key, stamp, write=True)
        source, target = src.tensor[:n], dst.tensor[:n]

        def action() -> None:
            target.copy_(source, non_blocking=True)

        self._copy(action, src, stream, stamp)

    def launch(
        self,
        fn: Callable[[], None],
        *,
        name: str = "kernel",
        stream: Stream | None = None,
        reads: Iterable[DeviceBuffer] = (),
        writes: Iterable[DeviceBuffer] = (),
        blocks_read: Iterable[int] = (),
        blocks_written: Iterable[int] = (),
    ) -> OpStamp:
        """Enqueue ``fn`` as one kernel on ``stream``.

        ``fn`` issues the device work: it runs now under the stream on cuda, and when the stream
        reaches it on the simulator, so it must read its inputs when called. The declared
        accesses feed the happens-before checker: device buffers by identity, KV-cache blocks by
        logical block id.
        """
        stream = self._resolve(stream)
        stamp = self._stamp(name, stream, reads, writes, blocks_read, blocks_written)
        self._launch(fn, stream, stamp)
        return stamp

    def _stamp(self, what: str, stream: Stream, reads: Iterable[DeviceBuffer], writes: Iterable[DeviceBuffer],
               blocks_read: Iterable[int], blocks_written: Iterable[int]) -> OpStamp:
        """Enqueue the op ``what`` on ``stream`` with the happens-before checker; tell it what it reads and writes."""
        stamp = self.hb.enqueue(stream.thread, self._label(what, stream), self.host_thread())
        if not self.checked:  # unchecked: even no-op calls would cost ~0.1 us per block
            return stamp
        for buffers, write in ((reads, False), (writes, True)):
            for buf in buffers:
                self.hb.device_access(buf.key, stamp, write=write, ranges=getattr(buf, "ranges", None))
        for blocks, write in ((blocks_read, False), (blocks_written, True)):
            for block in blocks:
                self.hb.device_access(("block", self._block_space, int(block)), stamp, write=write)
        return stamp

    def run_now(
        self,
        fn: Callable[[], None],
        *,
        name: str = "op",
        stream: Stream | None = None,
        reads: Iterable[DeviceBuffer] = (),
        writes: Iterable[DeviceBuffer] = (),
        blocks_read: Iterable[int] = (),
        blocks_written: Iterable[int] = (),
    ) -> None:
        """Run ``fn`` as one op on ``stream`` that the host waits for, as a synchronising CUDA call
        does (``.item()``, a blocking copy): the stream's queued work runs first, then ``fn``, and
        the host has then seen the stream up to and including it. ``fn`` may block the host (it
        runs while the stream is idle, never behind a gate). Accesses are declared as for
        :meth:`launch`."""
        stream = self._resolve(stream)
        self.synchronize_stream(stream)
        stamp = self._stamp(name, stream, reads, writes, blocks_read, blocks_written)
        self._run_now(fn, stream, stamp)
        self.hb.host_observes_stream(stream.thread, self.host_thread())

    def query_stream(self, stream: Stream | None = None) -> bool:
        """True when every op queued on ``stream`` has run; the host then knows they did."""
        stream = self._resolve(stream)
        done = self._stream_done(stream)
        if done:
            self.hb.host_observes_stream(stream.thread, self.host_thread())
        return done

    def delay(self, stream: Stream | None, amount: int) -> None:
        """Hold ``stream`` back by ``amount`` units to widen race windows.

        Simulator and controlled cuda: the stream needs ``amount`` extra scheduling steps.
        Free-running cuda: ``torch.cuda._sleep`` for ``amount`` units of device cycles.
        """
        stream = self._resolve(stream)
        if not isinstance(amount, int) or amount < 1:
            raise RuntimeUsageError(f"delay amount {amount!r} must be a positive int (units)")
        stamp = self.hb.enqueue(stream.thread, self._label(f"delay({amount})", stream), self.host_thread())
        self._delay(stream, amount, stamp)

    def hold(self, stream: Stream | None = None) -> Hold:
        """Stop ``stream`` at this point until :meth:`release`. Synchronising on held work is
        a :class:`~zeroer.errors.DeadlockError`, never a hang."""
        stream = self._resolve(stream)
        stamp = self.hb.enqueue(stream.thread, self._label("hold", stream), self.host_thread())
        hold = Hold(stream, stamp.label)
        self._hold(hold, stamp)
        return hold

    def release(self, hold: Hold) -> None:
        if hold.released:
            raise RuntimeUsageError(f"{hold.label} was already released")
        hold.released = True
        self._release(hold)

    # -- scheduling (meaningful where ``scheduled`` is True) ---------------------------------
    def advance(self, stream: Stream, ops: int = 1) -> int:
        """Let ``stream`` run up to ``ops`` queued steps now; return how many ran.

        This is the interleaving choice. On free-running cuda timing decides instead and this
        returns 0.
        """
        self._check_advance(stream, ops)
        return self._advance(stream, ops)

    def advance_through(self, stream: Stream, ops: int = 1) -> int:
        """Like :meth:`advance`, but where ``stream`` waits on another stream, that one first runs the
        least work the wait needs (the device runs them side by side): how far the code's own
        stream gets while the host does not wait for it. Returns the steps ``stream`` took."""
        self._check_advance(stream, ops)
        return self._advance_through(stream, ops)

    def _check_advance(self, stream: Stream, ops: int) -> None:
        self._check_stream(stream)
        if not isinstance(ops, int) or ops < 0:
            raise RuntimeUsageError(f"advance by {ops!r} ops: expected a non-negative int")

    def _advance_through(self, stream: Stream, ops: int) -> int:
        """By default, :meth:`advance` (a runtime whose streams the model does not run)."""
        return self._advance(stream, ops)

    def pending(self, stream: Stream) -> int:
        """Ops queued on ``stream`` and not yet executed (0 where the runtime cannot know)."""
        return 0

    def ungated(self) -> contextlib.AbstractContextManager[None]:
        """Run what is enqueued inside at once (the controlled cuda mode's warm-up scope; see
        :meth:`kvdevice.runtime.cuda.ControlledCudaRuntime.ungated`); elsewhere a plain scope."""
        return _NO_CONTEXT

    def close(self) -> None:
        """Let every queued op run and release backend resources."""
        self.synchronize()

    # -- backend hooks -------------------------------------------------------------------------
    def _check_usable(self) -> None:
        """Raise if this runtime can no longer be used (a closed cuda runtime); by default it can."""

    def _new_stream_handle(self, stream: Stream) -> object:
        return None

    def _use_stream_handle(self, stream: Stream) -> contextlib.AbstractContextManager:
        return _NO_CONTEXT  # nothing to switch

    def _elapsed(self, start: Event, end: Event) -> float:
        raise NotImplementedError

    def _new_event_handle(self, event: Event) -> object:
        return None

    def _run_now(self, fn: Callable[[], None], stream: Stream, stamp: OpStamp) -> None:
        """``run_now``'s device part, called once ``stream`` is idle: by default one launch and a sync."""
        self._launch(fn, stream, stamp)
        self._sync_stream(stream)

    def _stream_done(self, stream: Stream) -> bool:
        """Whether ``stream`` has nothing queued that has not run (queue-model backends answer from
        the model)."""
        return self.pending(stream) == 0

    @abstractmethod
    def _record(self, event: Event, stream: Stream, stamp: OpStamp) -> None: ...

    @abstractmethod
    def _wait(self, event: Event, stream: Stream, stamp: OpStamp) -> None: ...

    @abstractmethod
    def _event_done(self, event: Event) -> bool: ...

    @abstractmethod
    def _sync_event(self, event: Event) -> None: ...

    @abstractmethod
    def _sync_stream(self, stream: Stream) -> None: ...

    @abstractmethod
    def _sync_all(self) -> None: ...

    @abstractmethod
    def _alloc_host(self, n: int, dtype: torch.dtype, protected: bool) -> HostBuffer: ...

    @abstractmethod
    def _free_host(self, buf: HostBuffer) -> None: ...

    @abstractmethod
    def _copy(self, action: Callable[[], None], src: HostBuffer, stream: Stream, stamp: OpStamp) -> None: ...

    @abstractmethod
    def _launch(self, fn: Callable[[], None], stream: Stream, stamp: OpStamp) -> None: ...

    @abstractmethod
    def _delay(self, stream: Stream, amount: int, stamp: OpStamp) -> None: ...

    @abstractmethod
    def _hold(self, hold: Hold, stamp: OpStamp) -> None: ...

    @abstractmethod
    def _release(self, hold: Hold) -> None: ...

    @abstractmethod
    def _advance(self, stream: Stream, ops: int) -> int: ...
