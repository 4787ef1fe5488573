"""Vector clocks for host threads and streams: who has learned what about whom.

The model. Every host thread and every stream is a *thread* of the clock space with an index; the
first host thread is :data:`HOST` (index 0). Each has a vector clock, one entry per thread.

* Enqueueing work on a stream from a host thread orders the work after everything that host
  thread knows (the work cannot start before it is enqueued): the stream's clock joins the host
  thread's, then ticks. The tick is the op's position on its stream.
* Recording an event snapshots its stream's clock; waiting on the event joins that snapshot into
  the waiting stream.
* A host thread learns a snapshot only when it *observes* completion (a synchronisation, a query
  that answered True, an allocator that waited for an event): its clock joins the snapshot.
* Host threads learn from each other through hand-offs (a thread started or joined, a queue, an
  event, a future): the receiver joins the sender's clock (:meth:`Clocks.snapshot`,
  :meth:`Clocks.host_join`).

:attr:`Clocks.union` is the join of every host thread's clock: what *some* host thread has seen.
When a host thread touches memory that another host thread saw a copy finish on, but no hand-off
the checker follows carries that knowledge over, the access is ordered only by a hand-off it cannot
see (a lock, a flag): :mod:`racecheck.hb` says so in a note instead of calling it a race.

Example::

    clocks = Clocks()
    side = clocks.add("side")
    stamp = clocks.tick(side, "copy#1")        # queued on 'side' by the host
    clocks.ordered(stamp, clocks.vc(HOST))      # False: the host has not seen it run
    clocks.host_join(HOST, clocks.snapshot(side))
    clocks.ordered(stamp, clocks.vc(HOST))      # True
"""

from __future__ import annotations

from dataclasses import dataclass

HOST = 0  # index of the first host thread in every vector clock


@dataclass(frozen=True, slots=True)  # one per op a checker stamps: no __dict__ each
class OpStamp:
    """Where an enqueued operation sits in happens-before order."""

    thread: int  # stream thread index
    clock: int  # that stream's clock at this op
    vc: tuple[int, ...]  # the full vector clock at this op
    label: str  # what the op is, for reports
    seq: int = 0  # when it was enqueued, over every stream: a report names the earlier op first


def ordered(earlier: OpStamp, later_vc: tuple[int, ...] | list[int]) -> bool:
    """True when ``earlier`` happens before whatever ``later_vc`` describes."""
    return earlier.thread < len(later_vc) and earlier.clock <= later_vc[earlier.thread]


def _join(into: list[int], other: tuple[int, ...] | list[int]) -> bool:
    """Join ``other`` into ``into``; whether anything grew."""
    grew = False
    for i, value in enumerate(other):
        if value > into[i]:
            into[i] = value
            grew = True
    return grew


class Clocks:
    """The vector clocks of one process (see the module docstring)."""

    def __init__(self) -> None:
        self.names: list[str] = ["host"]
        self.hosts: list[int] = [HOST]  # indices of host threads
        self._vc: list[list[int]] = [[0]]
        self.union: list[int] = [0]  # join of every host thread's clock
        self._seq = 0  # ops stamped so far

    def add(self, name: str, *, host: bool = False) -> int:
        """A new stream (or host thread, with ``host=True``); its index."""
        for vc in self._vc:
            vc.append(0)
        self.union.append(0)
        self.names.append(name)
        self._vc.append([0] * len(self.names))
        index = len(self.names) - 1
        if host:
            self.hosts.append(index)
        return index

    def fork(self, parent: int, name: str) -> int:
        """A host thread started by ``parent``: it knows what its parent knew."""
        child = self.add(name, host=True)
        self.host_join(child, self._vc[parent])
        return child

    def vc(self, thread: int) -> list[int]:
        return self._vc[thread]

    def snapshot(self, thread: int) -> tuple[int, ...]:
        """What ``thread`` knows now: what an event recorded on a stream, or a hand-off from a host thread, carries."""
        return tuple(self._vc[thread])

    def tick(self, stream: int, label: str, host: int = HOST) -> OpStamp:
        """Stamp an op that host thread ``host`` enqueues on ``stream``."""
        vc = self._vc[stream]
        _join(vc, self._vc[host])
        vc[stream] += 1
        self._seq += 1
        return OpStamp(stream, vc[stream], tuple(vc), label, self._seq)

    def join(self, thread: int, snapshot: tuple[int, ...] | list[int] | None) -> None:
        """``thread`` (a stream waiting on an event) learns ``snapshot``."""
        if snapshot is not None:
            _join(self._vc[thread], snapshot)

    def host_join(self, host: int, snapshot: tuple[int, ...] | list[int] | None) -> None:
        """Host thread ``host`` learns ``snapshot`` (an observed completion, or a hand-off)."""
        if snapshot is not None and _join(self._vc[host], snapshot):
            _join(self.union, self._vc[host])

    @property
    def stamped(self) -> int:
        """How many ops have been stamped so far (an op's ``seq`` is its number among them)."""
        return self._seq

    @property
    def several_hosts(self) -> bool:
        return len(self.hosts) > 1
