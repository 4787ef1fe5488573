"""Per-stream FIFO queues of device work, and which of it may run next.

This is the scheduling model shared by the simulator and by the cuda backend's controlled mode.
Each stream holds a FIFO of queued ops. An op runs only at the head of its queue. A ``wait`` op
is blocked until the event position it waits for has executed; a ``hold`` op is blocked until the
host releases it; a ``sleep`` op of ``amount`` units needs that many scheduling steps. What runs,
and when, is decided from outside:

* ``advance(stream, k)`` runs up to ``k`` steps of one stream and stops early at a blocked op:
  this is the interleaving choice the fuzzer draws;
* ``run_until(stream, seq)`` is what a host synchronisation does: the least work that gets
  ``stream`` past position ``seq``, following ``wait`` ops into the streams they wait on. Work
  behind an unreleased hold can never run, and that is reported as a :class:`DeadlockError`.

With CUDA's semantics (a wait refers to an event position that was already enqueued) waits alone
cannot form a cycle, so only holds can deadlock.

The backend supplies ``execute(op)``: the simulator performs the op on CPU tensors, the controlled
cuda backend opens the gate in front of the op and waits for it to finish.

Observers (``StreamQueues(execute, observers=[fn])``, or appended to ``q.observers`` later) are
told ``fn(what, stream, op)`` with ``what`` one of ``"enqueued"`` (the op has its position),
``"executed"`` (it ran and left its queue) or ``"failed"`` (``execute`` raised; the op left its
queue all the same). Nothing else records when an op ran; ``python -m repro timeline`` draws a
trace from them. An observer must not raise. With none, the cost is one ``if`` per enqueue and
per executed op.

Example::

    q = StreamQueues(execute=lambda op: print("run", op.label))
    a, b = q.add_stream("a"), q.add_stream("b")
    q.enqueue(a, QueuedOp("kernel", "k1"))
    pos = q.enqueue(a, QueuedOp("record", "e1"))
    q.enqueue(b, QueuedOp("wait", "w1", wait_for=(a, pos)))
    q.advance(b, 1)        # 0: b is blocked on a
    q.run_until(b, 1)      # runs k1, e1, then w1
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable

from racecheck.errors import DeadlockError, RuntimeUsageError

if TYPE_CHECKING:
    from kvdevice.runtime.op_origin import OpOrigin
    from racecheck.hb import OpStamp
    from kvdevice.runtime.base import Event, Hold, Stream


@dataclass
class QueuedOp:
    """One unit of device work as the scheduling model sees it."""

    kind: str  # "copy" | "kernel" | "record" | "wait" | "sleep" | "hold"
    label: str
    action: Callable[[], None] | None = None  # what the backend does when the op executes
    wait_for: tuple[int, int] | None = None  # (stream, position) a "wait" op needs executed
    remaining: int = 1  # steps left ("sleep" ops have ``amount`` of them)
    released: bool = False  # "hold" ops only
    seq: int = 0  # 1-based position in its stream, set by enqueue
    payload: dict = field(default_factory=dict)  # backend-specific data (gates, cuda events)
    origin: OpOrigin | None = None  # whose code queued it, in which call (kvdevice.runtime.op_origin)
    inference: bool = False  # queued under torch.inference_mode(): a backend that runs it later runs it so


Observer = Callable[[str, int, QueuedOp], None]  # (what, stream, op); see the module docstring


class StreamQueues:
    """FIFO queues for a set of streams, with the runnable rule and minimal-progress sync."""

    def __init__(self, execute: Callable[[QueuedOp], None], observers: Iterable[Observer] = ()) -> None:
        self._execute = execute
        self.observers: list[Observer] = list(observers)
        self._queues: list[deque[QueuedOp]] = []
        self._names: list[str] = []
        self.enqueued: list[int] = []  # positions handed out per stream
        self.steps = 0  # scheduling steps taken, all streams

    # An op counts as executed once it has left its queue; nothing else records it. A count kept
    # beside the queue disagreed with it when Ctrl-C (or any exception) landed between the two
    # updates, and the next synchronisation indexed an empty queue (IndexError): now every state
    # change is one step (tests/test_interrupts.py interrupts every bytecode of this module).
    def _executed(self, stream: int) -> int:
        queue = self._queues[stream]
        return queue[0].seq - 1 if queue else self.enqueued[stream]

    @property
    def executed(self) -> list[int]:
        """Ops that have left their queue (run, or raised while running), per stream."""
        return [self._executed(stream) for stream in range(len(self._queues))]

    def add_stream(self, name: str) -> int:
        self._queues.append(deque())
        self._names.append(name)
        self.enqueued.append(0)
        return len(self._queues) - 1

    def enqueue(self, stream: int, op: QueuedOp) -> int:
        """Append ``op`` to ``stream``; return its position (1-based)."""
        # The position is taken before the append: cut off in between, it is a gap nobody holds,
        # never a position handed out twice.
        self.enqueued[stream] += 1
        op.seq = self.enqueued[stream]
        self._queues[stream].append(op)
        if self.observers:
            self._notify("enqueued", stream, op)
        return op.seq

    def completed(self, stream: int, seq: int) -> bool:
        return self._executed(stream) >= seq

    def pending(self, stream: int) -> int:
        return len(self._queues[stream])

    def head(self, stream: int) -> QueuedOp | None:
        queue = self._queues[stream]
        return queue[0] if queue else None

    def blocked_reason(self, stream: int) -> str | None:
        """Why the head of ``stream`` cannot run now, or None when it can (or the queue is empty)."""
        op = self.head(stream)
        if op is None:
            return None
        if op.kind == "wait" and op.wait_for is not None and not self.completed(*op.wait_for):
            other, pos = op.wait_for
            return f"{op.label} waits for op {pos} of stream '{self._names[other]}'"
        if op.kind == "hold" and not op.released:
            return f"{op.label} is held until the host releases it"
        return None

    def _step(self, stream: int) -> None:
        op = self._queues[stream][0]
        op.remaining -= 1
        self.steps += 1
        if op.remaining > 0:
            return
        self._queues[stream].popleft()  # executed from here on, whatever execute() does
        try:
            self._execute(op)
        except BaseException:
            if self.observers:
                self._notify("failed", stream, op)
            raise
        if self.observers:
            self._notify("executed", stream, op)

    def _notify(self, what: str, stream: int, op: QueuedOp) -> None:
        for observer in self.observers:
            observer(what, stream, op)

    def advance(self, stream: int, k: int = 1) -> int:
        """Run up to ``k`` steps of ``stream``; stop at a blocked op. Return the steps taken."""
        taken = 0
        while taken < k and self._queues[stream] and self.blocked_reason(stream) is None:
            self._step(stream)
            taken += 1
        return taken

    def advance_through(self, stream: int, k: int = 1) -> int:
        """Run up to ``k`` steps of ``stream``; where its head waits on another stream, first the least
        work that gets that stream there (:meth:`run_until`), as the device runs streams side by
        side; stop at a hold. Return the steps of ``stream`` taken."""
        taken = 0
        while taken < k and self._queues[stream]:
            op = self._queues[stream][0]
            if op.kind == "wait" and op.wait_for is not None and not self.completed(*op.wait_for):
                try:
                    self.run_until(*op.wait_for)
                except DeadlockError:  # a hold on the way: what ran before it stands
                    break
                continue
            if op.kind == "hold" and not op.released:
                break
            self._step(stream)
            taken += 1
        return taken

    def run_until(self, stream: int, seq: int) -> None:
        """Do the least work that executes ``stream`` through position ``seq``."""
        if seq > self.enqueued[stream]:
            raise RuntimeUsageError(f"position {seq} of stream '{self._names[stream]}' was never enqueued "
                             f"(it has {self.enqueued[stream]}); synchronise on a recorded event's position")
        while self._executed(stream) < seq:
            op = self._queues[stream][0]
            if op.kind == "wait" and op.wait_for is not None and not self.completed(*op.wait_for):
                self.run_until(*op.wait_for)
                continue
            if op.kind == "hold" and not op.released:
                raise DeadlockError(self._deadlock_message(stream, seq))
            while op.remaining > 1:  # a sync burns a whole sleep at once
                op.remaining -= 1
                self.steps += 1
            self._step(stream)

    def drain(self, stream: int) -> None:
        self.run_until(stream, self.enqueued[stream])

    def drain_all(self) -> None:
        for stream in range(len(self._queues)):
            self.drain(stream)

    def release(self, op: QueuedOp) -> None:
        op.released = True

    def _deadlock_message(self, stream: int, seq: int) -> str:
        lines = [
            f"deadlock: the host waits for op {seq} of stream '{self._names[stream]}', "
            f"which can never run"
        ]
        for index, name in enumerate(self._names):
            reason = self.blocked_reason(index)
            if reason is not None:
                lines.append(f"  stream '{name}': {reason}")
        lines.append("release the hold (Runtime.release) before synchronising")
        return "\n".join(lines)


class ModelledStreams:
    """The runtime hooks that only the model answers, for a runtime whose streams run when its
    ``queues`` say: the simulator and the controlled cuda runtime (mixed in before their base,
    which provides ``_enqueue(stream, op)`` and ``_check_usable()``)."""

    queues: StreamQueues
    origin: OpOrigin  # the runtime's: what an op enqueued now carries (Runtime.annotate)

    def pending(self, stream: Stream) -> int:
        return self.queues.pending(stream.index)

    def _stream_done(self, stream: Stream) -> bool:
        # The model moves only while the host waits for the device, so it answers for both.
        self._check_usable()
        return self.queues.pending(stream.index) == 0

    def _event_done(self, event: Event) -> bool:
        self._check_usable()
        return event.stream is None or self.queues.completed(event.stream.index, event.position)

    def _delay(self, stream: Stream, amount: int, stamp: OpStamp) -> None:
        self._check_usable()
        # The model makes the stream take ``amount`` steps (on cuda the op's gate alone enforces that).
        self._enqueue(stream, QueuedOp("sleep", stamp.label, remaining=amount, origin=self.origin))

    def _hold(self, hold: Hold, stamp: OpStamp) -> None:
        self._check_usable()
        # It runs once the host released the hold AND the model runs it.
        op = QueuedOp("hold", stamp.label, origin=self.origin)
        hold.payload["op"] = op
        self._enqueue(hold.stream, op)

    def _release(self, hold: Hold) -> None:
        self._check_usable()
        self.queues.release(hold.payload["op"])

    def _advance(self, stream: Stream, ops: int) -> int:
        self._check_usable()
        return self.queues.advance(stream.index, ops)

    def _advance_through(self, stream: Stream, ops: int) -> int:
        self._check_usable()
        return self.queues.advance_through(stream.index, ops)
