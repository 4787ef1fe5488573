"""A happens-before checker over the runtime's operations.

Model. There is one host thread (index 0) and one thread per stream (index 1..n). Each has a
vector clock. Enqueueing work on a stream orders it after everything the host did before (the
work cannot start before it is enqueued); recording an event snapshots the stream's clock;
``wait_event`` joins that snapshot into the waiting stream; the host learns a snapshot only when it
*observes* completion: ``Event.synchronize``, an ``Event.query`` that returned True, a stream or
device synchronisation, or the caching host allocator reusing a block whose events completed.

All of this is computed when work is enqueued, never from when it happens to run, so the verdict
does not depend on timing: a race is reported even on a run where the values came out right.
That is what PyTorch's CUDA sanitizer cannot do for this bug class: it ignores host writes to
pinned memory (the #48085 overwrite) and kernels that write through a raw address table.

Two checks:

* **host write vs. pending copy**: the host rewrites a host buffer that a non-blocking copy reads,
  and the host has not observed that copy's completion (vLLM #48085; the ring of #48085 when more
  calls are outstanding than its depth; pinned memory outside the caching allocator).
* **unordered device accesses**: two accesses to one device resource (a device buffer, or a KV
  cache block) from different streams, at least one a write, with no event path between them.

Example::

    hb = HappensBefore()
    s = hb.add_stream("main")
    copy = hb.enqueue(s, "copy#1")
    hb.device_read(("host", 7), copy)    # the copy reads host buffer 7 when it runs
    hb.host_write(("host", 7), "zero_block_ids#2")
    assert hb.hazards                     # nothing told the host that the copy had run
"""

from __future__ import annotations

from dataclasses import dataclass, field

Key = tuple  # ("host", id) / ("dev", id) / ("block", id)

HOST = 0  # thread index of the host in every vector clock


@dataclass(frozen=True)
class OpStamp:
    """Where an enqueued operation sits in happens-before order."""

    thread: int  # stream thread index (>= 1)
    clock: int  # that stream's clock at this op
    vc: tuple[int, ...]  # the full vector clock at this op
    label: str  # human-readable name, e.g. "copy#12 on stream 'main' (zero_block_ids#3)"


@dataclass(frozen=True)
class Hazard:
    """One happens-before violation, already phrased for a person."""

    kind: str  # "host-write-vs-pending-copy" or "unordered-device-access"
    resource: str
    first: str
    second: str
    message: str

    def __str__(self) -> str:
        return self.message


@dataclass
class _ResourceState:
    last_write: OpStamp | None = None
    reads: dict[int, OpStamp] = field(default_factory=dict)  # latest read per stream thread


def _ordered(earlier: OpStamp, later_vc: tuple[int, ...] | list[int]) -> bool:
    """True when ``earlier`` happens before whatever ``later_vc`` describes."""
    return earlier.thread < len(later_vc) and earlier.clock <= later_vc[earlier.thread]


class HappensBefore:
    """Vector-clock bookkeeping for one runtime. See the module docstring for the model."""

    def __init__(self) -> None:
        self._names: list[str] = ["host"]
        self._clocks: list[list[int]] = [[0]]  # one vector clock per thread
        self._resources: dict[Key, _ResourceState] = {}
        self._host_readers: dict[Key, list[OpStamp]] = {}  # copies that read a host buffer
        self._resource_names: dict[Key, str] = {}
        self.hazards: list[Hazard] = []

    # -- threads and clocks -------------------------------------------------------------------
    def add_stream(self, name: str) -> int:
        self._names.append(name)
        for vc in self._clocks:
            vc.append(0)
        self._clocks.append([0] * len(self._names))
        return len(self._names) - 1

    def _join(self, into: list[int], other: tuple[int, ...] | list[int]) -> None:
        for i, value in enumerate(other):
            if value > into[i]:
                into[i] = value

    def enqueue(self, thread: int, label: str) -> OpStamp:
        """Stamp an op enqueued by the host on stream ``thread``."""
        vc = self._clocks[thread]
        self._join(vc, self._clocks[HOST])
        vc[thread] += 1
        return OpStamp(thread, vc[thread], tuple(vc), label)

    def snapshot(self, thread: int) -> tuple[int, ...]:
        """The clock an event recorded now on ``thread`` carries."""
        return tuple(self._clocks[thread])

    def stream_waits(self, thread: int, snapshot: tuple[int, ...] | None) -> None:
        """``wait_event`` on ``thread`` for an event carrying ``snapshot`` (None: never recorded)."""
        if snapshot is not None:
            self._join(self._clocks[thread], snapshot)

    def host_observes(self, snapshot: tuple[int, ...] | None) -> None:
        """The host learned that everything up to ``snapshot`` has executed."""
        if snapshot is not None:
            self._join(self._clocks[HOST], snapshot)

    def host_has_seen(self, stamp: OpStamp) -> bool:
        """Whether the host has observed ``stamp``'s op complete (by a sync, a query or an allocator)."""
        return _ordered(stamp, self._clocks[HOST])

    def host_observes_stream(self, thread: int) -> None:
        self._join(self._clocks[HOST], self._clocks[thread])

    def host_observes_all(self) -> None:
        for thread in range(1, len(self._clocks)):
            self.host_observes_stream(thread)

    # -- resources ------------------------------------------------------------------------------
    def name_resource(self, key: Key, name: str) -> None:
        self._resource_names[key] = name

    def _name(self, key: Key) -> str:
        name = self._resource_names.get(key)
        if name is not None:
            return name
        if key[0] == "block" and len(key) == 3:  # ("block", cache, id): Runtime.block_space
            return f"block {key[2]}" + (f" of cache {key[1]}" if key[1] else "")
        return " ".join(str(part) for part in key)

    def forget(self, key: Key) -> None:
        """``key`` names new memory from now on (an allocator handed its address out again after
        waiting for its events itself): its access history starts over."""
        self._resources.pop(key, None)
        self._host_readers.pop(key, None)

    def copy_reads_host(self, key: Key, stamp: OpStamp) -> None:
        """A non-blocking copy ``stamp`` reads host buffer ``key`` when its stream reaches it."""
        self._host_readers.setdefault(key, []).append(stamp)

    def host_write(self, key: Key, label: str) -> None:
        """The host writes buffer ``key`` now; flag every copy of it the host has not seen run."""
        readers = self._host_readers.get(key)
        if not readers:
            return
        host_vc = self._clocks[HOST]
        pending = [r for r in readers if not _ordered(r, host_vc)]
        for reader in pending:
            self.hazards.append(
                Hazard(
                    kind="host-write-vs-pending-copy",
                    resource=self._name(key),
                    first=reader.label,
                    second=label,
                    message=(
                        f"host write to {self._name(key)} by {label} while {reader.label} may "
                        f"not have read it yet: no event or synchronisation observed by the host "
                        f"orders the copy before the write (the vLLM #48085 hazard)"
                    ),
                )
            )
        # Readers the host has seen complete can never conflict again; pending ones were reported.
        self._host_readers[key] = []

    def device_access(self, key: Key, stamp: OpStamp, *, write: bool) -> None:
        """``stamp`` reads or writes device resource ``key``; flag unordered conflicting accesses."""
        state = self._resources.get(key)
        if state is None:
            state = self._resources[key] = _ResourceState()
        conflicts: list[tuple[OpStamp, str]] = []
        last = state.last_write
        if last is not None and last.thread != stamp.thread and not _ordered(last, stamp.vc):
            conflicts.append((last, "writes"))
        if write:
            for reader in state.reads.values():
                if reader.thread != stamp.thread and not _ordered(reader, stamp.vc):
                    conflicts.append((reader, "reads"))
        for other, verb in conflicts:
            mine = "writes" if write else "reads"
            self.hazards.append(
                Hazard(
                    kind="unordered-device-access",
                    resource=self._name(key),
                    first=other.label,
                    second=stamp.label,
                    message=(
                        f"{self._name(key)}: {other.label} {verb} it and {stamp.label} {mine} it "
                        f"with no event path between stream '{self._names[other.thread]}' and "
                        f"stream '{self._names[stamp.thread]}'"
                    ),
                )
            )
        if write:
            state.last_write = stamp
            state.reads = {}
        else:
            state.reads[stamp.thread] = stamp
