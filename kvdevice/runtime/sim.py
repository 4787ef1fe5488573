"""A deterministic CPU simulator of CUDA streams, for CI and for every developer machine.

The model (what a GPU does that matters for these races, and nothing else):

* every stream is a FIFO of queued ops (:mod:`kvdevice.runtime.queues`); nothing runs at enqueue;
* a non-blocking copy reads its host source when the simulated stream *executes* it, and a kernel
  reads the device id buffer when it executes, so a host rewrite in between is seen (vLLM #48085);
* events complete when their stream reaches them; ``wait_event`` holds a stream until then;
  host synchronisation runs the least queued work that satisfies it, and work behind an
  unreleased hold is reported as a deadlock;
* a timing event's record takes the simulator's clock when it executes: one scheduling step is
  :data:`SIM_MS_PER_STEP` ms, so ``elapsed_time`` is consistent with what ran in between;
* pinned memory comes from a caching host allocator that, like PyTorch's, hands a freed block
  out again only once the events recorded on it by copies have completed; unprotected memory
  (the ``cudaHostRegister`` / ``from_blob`` hazard) is reused as soon as it is freed.

Which queued work runs, relative to the host and across streams, is decided from outside:
by explicit ``advance(stream, k)`` calls (the fuzzer draws them) and by a :class:`Schedule`
consulted after every host call. The default schedule runs nothing, i.e. the GPU is arbitrarily
far behind the host. Every interleaving is therefore reproducible from data alone.

Device memory is CPU memory; kernels (the Triton interpreter, torch indexing) run on it when
their op executes.

Example::

    rt = SimRuntime()
    buf, dev = rt.host_buffer(1), rt.device_buffer(1)
    rt.write_host(buf, [1])
    rt.copy_h2d(dev, buf)
    rt.write_host(buf, [2])           # the copy has not run: the hazard is recorded
    rt.synchronize()
    assert dev.tensor.tolist() == [2] and rt.hazards
"""

from __future__ import annotations

import random
from typing import Callable, Protocol

import torch

from kvdevice.runtime.base import Event, HostBuffer, Runtime, Stream
from racecheck.hb import OpStamp
from kvdevice.runtime.host_memory import size_class
from kvdevice.runtime.op_origin import mark_failed
from kvdevice.runtime.queues import ModelledStreams, QueuedOp, StreamQueues

#: Simulated milliseconds per scheduling step: what a timing event's elapsed_time counts in.
SIM_MS_PER_STEP = 0.001


class Schedule(Protocol):
    """Decides what device work runs between host calls."""

    def after_host_call(self, rt: "SimRuntime") -> None: ...


class LazySchedule:
    """Run nothing on its own: the device is as far behind the host as the program allows."""

    def after_host_call(self, rt: "SimRuntime") -> None:
        return None


class EagerSchedule:
    """Run every runnable op after each host call: a device that is never behind."""

    def after_host_call(self, rt: "SimRuntime") -> None:
        while any(rt.queues.advance(s.index, 1 << 30) for s in rt.streams):
            pass  # again, until no stream can progress


class RandomSchedule:
    """After each host call, advance random streams by random amounts, from one seeded ``rng``.

    Register ``rng`` with ``hypothesis.register_random`` to make it shrinkable.
    """

    def __init__(self, rng: random.Random, max_ops: int = 3) -> None:
        self.rng = rng
        self.max_ops = max_ops

    def after_host_call(self, rt: "SimRuntime") -> None:
        for stream in rt.streams:
            if self.rng.random() < 0.5:
                rt.queues.advance(stream.index, self.rng.randint(0, self.max_ops))


class SimHostAllocator:
    """Pinned host memory with PyTorch's caching-host-allocator reuse rule.

    Blocks are sized in powers of two of bytes, like PyTorch's (:func:`size_class`). A freed
    protected block goes back to a free list together with the events recorded on it; ``alloc``
    takes the oldest free block of the right size whose events have all completed (the allocator
    has then *observed* them, which the happens-before checker learns), else a new block.
    Unprotected blocks have no events and are reused newest-first at once.
    """

    def __init__(self, rt: "SimRuntime") -> None:
        self._rt = rt
        self._next_block = 1
        self._free: dict[tuple[bool, int], list[int]] = {}  # (protected, size) -> block ids
        self._storage: dict[int, torch.Tensor] = {}  # block id -> its bytes
        self.events: dict[int, list[Event]] = {}  # protected block id -> events of the copies that read it
        self.reused = 0  # blocks handed out again (tests read this)

    def alloc(self, n: int, dtype: torch.dtype, protected: bool) -> HostBuffer:
        nbytes = n * dtype.itemsize
        size = size_class(nbytes)
        free = self._free.setdefault((protected, size), [])
        if protected:  # the oldest block whose events have all completed
            chosen = next((b for b in free if all(self._rt._event_done(e) for e in self.events.get(b, []))), None)
        else:  # no events: the newest, at once
            chosen = free[-1] if free else None
        if chosen is None:
            chosen = self._next_block
            self._next_block += 1
            self._storage[chosen] = torch.zeros(size, dtype=torch.uint8)
        else:
            free.remove(chosen)
            for event in self.events.pop(chosen, []):  # the allocator looked: the host now knows they ran
                self._rt.hb.host_observes(event.hb_snapshot, self._rt.host_thread())
            self.reused += 1
        return HostBuffer(chosen, self._storage[chosen][:nbytes].view(dtype), protected)

    def free(self, buf: HostBuffer) -> None:
        size = self._storage[buf.block].numel()
        self._free.setdefault((buf.protected, size), []).append(buf.block)


class SimRuntime(ModelledStreams, Runtime):
    """The simulator backend. See the module docstring."""

    backend = "sim"
    scheduled = True

    def __init__(self, schedule: Schedule | None = None) -> None:
        self.queues = StreamQueues(execute=self._execute)
        self.executing = 0  # queued actions running now (the simulated device at work)
        self.schedule: Schedule = schedule or LazySchedule()
        super().__init__(torch.device("cpu"))
        self.allocator = SimHostAllocator(self)

    # -- plumbing ----------------------------------------------------------------------------
    def _execute(self, op: QueuedOp) -> None:
        if op.action is not None:
            self.executing += 1  # device work, run on the CPU: no host access of the program's
            try:
                if op.inference == torch.is_inference_mode_enabled():
                    op.action()
                else:  # torch checks inference tensors when the op runs here, not when it was queued
                    with torch.inference_mode(op.inference):
                        op.action()
            except Exception as error:  # a kernel that fails: say which op, for whoever judges and reports it
                mark_failed(error, op.label, op.origin)
                error.add_note(f"while running {op.label}")
                raise
            finally:
                self.executing -= 1

    def _after_host_call(self) -> None:
        self.schedule.after_host_call(self)

    def _new_stream_handle(self, stream: Stream) -> object:
        return self.queues.add_stream(stream.name)

    def _enqueue(self, stream: Stream, op: QueuedOp) -> int:
        position = self.queues.enqueue(stream.index, op)
        self._after_host_call()
        return position

    # -- events ------------------------------------------------------------------------------
    def _record(self, event: Event, stream: Stream, stamp: OpStamp) -> None:
        op = QueuedOp("record", stamp.label, origin=self.origin)
        if event.timing:
            def stamp_time() -> None:  # only the latest record of the event sets its time
                if event.stream is stream and event.position == op.seq:
                    event.time = self.queues.steps
            op.action = stamp_time
        event.position = self.queues.enqueue(stream.index, op)
        self._after_host_call()

    def _elapsed(self, start: Event, end: Event) -> float:
        assert start.time is not None and end.time is not None  # both complete (elapsed_time checked)
        return (end.time - start.time) * SIM_MS_PER_STEP

    def _wait(self, event: Event, stream: Stream, stamp: OpStamp) -> None:
        target = (event.stream.index, event.position) if event.stream is not None else None
        self._enqueue(stream, QueuedOp("wait", stamp.label, wait_for=target, origin=self.origin))

    def _sync_event(self, event: Event) -> None:
        self.queues.run_until(event.stream.index, event.position)

    def _sync_stream(self, stream: Stream) -> None:
        self.queues.drain(stream.index)

    def _sync_all(self) -> None:
        self.queues.drain_all()

    # -- memory ------------------------------------------------------------------------------
    def _alloc_host(self, n: int, dtype: torch.dtype, protected: bool) -> HostBuffer:
        return self.allocator.alloc(n, dtype, protected)

    def _free_host(self, buf: HostBuffer) -> None:
        self.allocator.free(buf)

    # -- work --------------------------------------------------------------------------------
    def _copy(self, action: Callable[[], None], src: HostBuffer, stream: Stream, stamp: OpStamp) -> None:
        self.queues.enqueue(stream.index, QueuedOp("copy", stamp.label, action=action, origin=self.origin,
                                                   inference=torch.is_inference_mode_enabled()))
        if src.protected:
            # PyTorch records an event on the pinned block behind every non-blocking copy of it
            # (CachingHostAllocator_recordEvent, pytorch/pytorch#130785); it is internal, so it
            # is not part of the program's happens-before order.
            marker = Event(0, stream=stream, position=self.queues.enqueued[stream.index])
            marker.hb_snapshot = stamp.vc
            self.allocator.events.setdefault(src.block, []).append(marker)
        self._after_host_call()

    def _launch(self, fn: Callable[[], None], stream: Stream, stamp: OpStamp) -> None:
        self._enqueue(stream, QueuedOp("kernel", stamp.label, action=fn, origin=self.origin,
                                       inference=torch.is_inference_mode_enabled()))
