"""The happens-before checker: what the host and the streams did to memory, and in which order.

Model (the clocks: :mod:`racecheck.clocks`). Host threads and streams each have a vector clock.
Enqueueing work on a stream orders it after everything the enqueueing host thread knows; events
carry a stream's clock to the streams that wait on them; a host thread learns that work ran only
when it *observes* it (a synchronisation, a query that answered True, an allocator that waited for
an event), or from another host thread through a hand-off.

All of this is computed when work is enqueued, never from when it happens to run, so the verdict
does not depend on timing: a race is reported on a run whose values came out right. That is what
PyTorch's CUDA sanitizer cannot do for this bug class: it ignores host access to pinned memory.

Five checks, each on the bytes the two sides touch (:mod:`racecheck.shadow`):

* **host write vs. pending copy**: a host thread writes host memory that a queued copy (or kernel)
  reads or writes when its stream reaches it, and that thread has not observed the copy complete
  (vLLM #48085; a ring deeper than its events; pinned memory outside the caching allocator);
* **host read vs. pending copy**: a host thread reads host memory that a queued device-to-host
  copy has not been observed to write yet (vLLM #36013);
* **unordered device accesses**: two accesses to the same bytes of a device resource from
  different streams, at least one a write, with no event path between them;
* **host read vs. pending event**: a host thread reads what the device writes when a stream
  reaches an event (its time: ``elapsed_time``) before it has observed the event complete: CUDA
  answers ``cudaErrorNotReady`` or the time, by timing (a job reported done before its copy ran).

When the conflict would be ordered by what *another* host thread saw (it observed the copy
complete, then handed over in a way the checker does not follow: a lock, a flag in memory), it is
recorded in :attr:`HappensBefore.notes`, not as a hazard: a hand-off the checker cannot see is
said in one line, never reported as a race.

What is kept is pruned only of what can no longer race, so nothing is missed for want of room, and a
run that synchronises stays small however long it runs: a queued copy is dropped once some host
thread has seen it complete, or when later copies on its stream cover its bytes (:func:`_unsettled`);
a host access kept for ops that declare theirs as they run, once every op queued before it has been
seen complete (:meth:`HappensBefore._log_host`).

Example::

    hb = HappensBefore()
    s = hb.add_stream("main")
    copy = hb.enqueue(s, "copy#1")
    hb.copy_reads_host(("host", 7), copy)   # the copy reads host buffer 7 when it runs
    hb.host_write(("host", 7), "host write")
    assert hb.hazards                       # nothing told the host that the copy had run
"""

from __future__ import annotations

import bisect
from collections import defaultdict, deque
from dataclasses import dataclass, field

from racecheck.clocks import HOST, Clocks, OpStamp, ordered
from racecheck.ranges import merge
from racecheck.shadow import RangeShadow, Ranges, overlaps

__all__ = ["DEVICE", "EVENT_READ", "HOST", "HOST_READ", "HOST_WRITE", "HappensBefore", "Hazard", "Key", "OpStamp", "Ranges"]

Key = tuple  # ("host", id) / ("dev", id) / ("block", cache, id) / ("cudamem", address) ...
# Both logs below are pruned only of entries that can no longer race, so a long run that synchronises
# stays small; a capped log that dropped its oldest entries missed races (a probe: 432 copies queued
# into one HiCache host pool, the host rewriting slots the oldest 48 were still writing).
PENDING_PRUNE_AT = 256  # pending copies of one host buffer past which those that can no longer conflict are pruned
HOST_LOG_SWEEP_AT = 1024  # host accesses logged past which every buffer's log drops those no op can race with

HOST_WRITE = "host-write-vs-pending-copy"
HOST_READ = "host-read-vs-pending-copy"
DEVICE = "unordered-device-access"
EVENT_READ = "host-read-vs-pending-event"


@dataclass(frozen=True)
class Hazard:
    """One happens-before violation, already phrased for a person (or, in ``notes``, a conflict
    that an unseen hand-off between host threads may order)."""

    kind: str  # HOST_WRITE, HOST_READ or DEVICE
    resource: str
    first: str  # the earlier op's label
    second: str  # the later access's label
    message: str
    key: Key | None = field(default=None, compare=False)  # the memory, as the checker keys it (("cudamem", address), ...)

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class _Pending:
    stamp: OpStamp
    ranges: Ranges


@dataclass(frozen=True, slots=True)
class _HostAccess:
    """A host thread's access to host memory, kept for an op whose accesses are declared as it runs."""

    kind: str  # HOST_WRITE or HOST_READ
    label: str
    vc: tuple[int, ...]  # the host thread's clock then
    after: int  # ops stamped before it: an op stamped later was enqueued after it
    ranges: Ranges
    union: tuple[int, ...] | None  # what some host thread had seen then, where there are several
    queued: tuple[int, ...]  # every stream's own clock then: the ops queued before it (see _log_host)


class HappensBefore:
    """Vector-clock bookkeeping for one process or runtime (see the module docstring)."""

    def __init__(self) -> None:
        self.clocks = Clocks()
        self._shadows: defaultdict[Key, RangeShadow] = defaultdict(RangeShadow)
        self._host_readers: dict[Key, list[_Pending]] = {}  # queued copies that read host memory
        self._host_writers: dict[Key, list[_Pending]] = {}  # queued copies that write host memory
        # Recent host accesses, kept only once an op may declare its host accesses as it runs
        # (expect_late_host_accesses): None until then, so the GPU observer's host ops pay nothing.
        self._host_log: defaultdict[Key, deque[_HostAccess]] | None = None
        self._logged = 0  # host accesses logged since every buffer's log was last swept
        self._sweep_at = HOST_LOG_SWEEP_AT
        self._queued_at: tuple[int, int] = (-1, 0)  # (ops stamped, threads) when _queued was last computed
        self._queued: tuple[int, ...] = ()
        self._prune_at: dict[tuple[bool, Key], int] = {}  # (writes, key) -> pending length that prunes next
        self._resource_names: dict[Key, str] = {}
        self.hazards: list[Hazard] = []
        self.notes: list[Hazard] = []

    # -- threads and clocks -------------------------------------------------------------------
    def add_stream(self, name: str) -> int:
        return self.clocks.add(name)

    def add_host(self, name: str, parent: int | None = HOST) -> int:
        """A new host thread; started by ``parent`` it knows what ``parent`` knew (None: nothing)."""
        if parent is None:
            return self.clocks.add(name, host=True)
        return self.clocks.fork(parent, name)

    def enqueue(self, thread: int, label: str, host: int = HOST) -> OpStamp:
        """Stamp an op that host thread ``host`` enqueues on stream ``thread``."""
        return self.clocks.tick(thread, label, host)

    def snapshot(self, thread: int) -> tuple[int, ...]:
        """The clock an event recorded now on ``thread`` carries."""
        return self.clocks.snapshot(thread)

    def stream_waits(self, thread: int, snapshot: tuple[int, ...] | None) -> None:
        """``wait_event`` on ``thread`` for an event carrying ``snapshot`` (None: never recorded)."""
        self.clocks.join(thread, snapshot)

    def host_observes(self, snapshot: tuple[int, ...] | None, host: int = HOST) -> None:
        """Host thread ``host`` learned that everything up to ``snapshot`` has executed."""
        self.clocks.host_join(host, snapshot)

    def host_observes_stream(self, thread: int, host: int = HOST) -> None:
        self.clocks.host_join(host, self.clocks.vc(thread))

    def host_observes_all(self, host: int = HOST) -> None:
        hosts = set(self.clocks.hosts)
        for thread in range(len(self.clocks.names)):
            if thread not in hosts:
                self.host_observes_stream(thread, host)

    def host_has_seen(self, stamp: OpStamp, host: int = HOST) -> bool:
        """Whether host thread ``host`` has observed ``stamp``'s op complete."""
        return ordered(stamp, self.clocks.vc(host))

    def seen_by_some_host(self, stamp: OpStamp) -> bool:
        """Whether any host thread has observed ``stamp``'s op complete."""
        return ordered(stamp, self.clocks.union)

    def host_snapshot(self, host: int = HOST) -> tuple[int, ...]:
        """What a hand-off from host thread ``host`` carries (:meth:`host_acquires` on the other side)."""
        return self.clocks.snapshot(host)

    def host_acquires(self, host: int, snapshot: tuple[int, ...] | None) -> None:
        """Host thread ``host`` received a hand-off carrying ``snapshot``."""
        self.clocks.host_join(host, snapshot)

    # -- resources ------------------------------------------------------------------------------
    def name_resource(self, key: Key, name: str) -> None:
        self._resource_names[key] = name

    def name(self, key: Key) -> str:
        name = self._resource_names.get(key)
        if name is not None:
            return name
        if key[0] == "block" and len(key) == 3:  # ("block", cache, id): Runtime.block_space
            return f"block {key[2]}" + (f" of cache {key[1]}" if key[1] else "")
        return " ".join(str(part) for part in key)


    def forget(self, key: Key) -> None:
        """``key`` names new memory from now on (an allocator handed its address out again after
        waiting for its events itself): its access history starts over."""
        self._shadows.pop(key, None)
        self._host_readers.pop(key, None)
        self._host_writers.pop(key, None)
        self._prune_at.pop((False, key), None)
        self._prune_at.pop((True, key), None)
        if self._host_log is not None:
            self._host_log.pop(key, None)

    # -- host memory -----------------------------------------------------------------------------
    def copy_reads_host(self, key: Key, stamp: OpStamp, ranges: Ranges = None) -> None:
        """A queued op ``stamp`` reads host memory ``key`` (``ranges`` of it) when its stream reaches it."""
        self._add_pending(self._host_readers, key, stamp, ranges)

    def copy_writes_host(self, key: Key, stamp: OpStamp, ranges: Ranges = None) -> None:
        """A queued device-to-host copy ``stamp`` writes host memory ``key`` when its stream reaches it."""
        self._add_pending(self._host_writers, key, stamp, ranges)

    def _add_pending(self, table: dict[Key, list[_Pending]], key: Key, stamp: OpStamp, ranges: Ranges) -> None:
        pending = table.setdefault(key, [])
        pending.append(_Pending(stamp, ranges))
        at = (table is self._host_writers, key)
        if len(pending) > self._prune_at.get(at, PENDING_PRUNE_AT):
            pending[:] = _unsettled(pending, self.clocks.union)
            # twice what is left: pruning stays linear in the copies queued, and a copy that can
            # still conflict is never dropped, however many are pending (the HiCache probe: 432)
            self._prune_at[at] = max(PENDING_PRUNE_AT, 2 * len(pending))

    def pending_writes(self, key: Key, host: int = HOST, ranges: Ranges = None) -> list[OpStamp]:
        """The queued device-to-host copies into ``ranges`` of ``key`` that host thread ``host``
        has not observed complete: while one is pending the bytes change under the host."""
        return [p.stamp for p in self._host_writers.get(key, ())
                if overlaps(p.ranges, ranges) and not self.host_has_seen(p.stamp, host)]

    def host_write(self, key: Key, label: str, host: int = HOST, ranges: Ranges = None) -> None:
        """Host thread ``host`` writes ``ranges`` of host memory ``key`` now: every queued copy that
        reads or writes those bytes and that the thread has not seen complete is a hazard."""
        self._log_host(HOST_WRITE, key, label, host, ranges)
        self._host_access(HOST_WRITE, key, label, host, ranges, (self._host_readers, self._host_writers))

    def host_read(self, key: Key, label: str, host: int = HOST, ranges: Ranges = None) -> None:
        """Host thread ``host`` reads ``ranges`` of host memory ``key`` now: every queued copy that
        writes those bytes and that the thread has not seen complete is a hazard."""
        self._log_host(HOST_READ, key, label, host, ranges)
        self._host_access(HOST_READ, key, label, host, ranges, (self._host_writers,))

    def expect_late_host_accesses(self) -> None:
        """An op about to be queued declares its host accesses only as it runs (:meth:`late_host_access`):
        from now on host accesses are kept for it (one made before its enqueue never concerns it)."""
        if self._host_log is None:
            self._host_log = defaultdict(deque)

    def _log_host(self, kind: str, key: Key, label: str, host: int, ranges: Ranges) -> None:
        """Keep a host access for the ops queued before it that may declare theirs as they run.

        Such an op declares when it runs, and an op some host thread has seen complete has run: an
        access made after every op queued before it was seen complete (by this thread: never
        kept; by any thread since: pruned) can meet no declaration to come. Nothing else is
        dropped, however many accesses wait behind an op not yet run (a cap of 64 hid a
        ``fill_`` behind 64 reads of other rows)."""
        if self._host_log is None:
            return
        clocks = self.clocks
        vc = tuple(clocks.vc(host))
        queued = self._queued_now()
        if _all_seen(queued, vc):
            return  # every op queued so far had been seen complete by this thread: none can race with it
        log = self._host_log[key]
        _prune_seen(log, clocks.union)
        log.append(_HostAccess(kind, label, vc, clocks.stamped, ranges,
                               tuple(clocks.union) if clocks.several_hosts else None, queued))
        self._logged += 1
        if self._logged > self._sweep_at:
            self._sweep_host_log()

    def _queued_now(self) -> tuple[int, ...]:
        """Every thread's own clock now (the ops queued so far); only a new op changes it, so one
        tuple serves every access between two ops."""
        clocks = self.clocks
        at = (clocks.stamped, len(clocks.names))
        if at != self._queued_at:
            self._queued_at = at
            self._queued = tuple(clocks.vc(thread)[thread] for thread in range(at[1]))
        return self._queued

    def _sweep_host_log(self) -> None:
        """Prune every buffer's log, not only those accessed again (a loop over fresh buffers);
        the next sweep comes after twice as many accesses as are left, so sweeping stays linear."""
        host_log = self._host_log or {}
        union = self.clocks.union
        for key in list(host_log):
            _prune_seen(host_log[key], union)
            if not host_log[key]:
                del host_log[key]
        left = sum(len(log) for log in host_log.values())
        self._logged = 0
        self._sweep_at = max(HOST_LOG_SWEEP_AT, 2 * left)

    def late_host_access(self, key: Key, stamp: OpStamp, *, write: bool, ranges: Ranges = None) -> None:
        """Queued op ``stamp`` reads or writes ``ranges`` of host memory ``key``, known only as it
        runs (its addresses come from device values: a table kernel, a custom op's index tensors).
        Every host access made since it was enqueued, by a thread that had not seen it complete, is
        checked as if the op had been pending then (LMCache #4830: the next ``pin_memory()`` rewrote
        a temporary the copy still read); from now on the bytes are pending like any copy's. The op's
        session said so before queueing it (:meth:`expect_late_host_accesses`)."""
        for access in (self._host_log or {}).get(key, ()):
            if access.after < stamp.seq or ordered(stamp, access.vc) or not overlaps(access.ranges, ranges):
                continue  # before the enqueue, after the host saw it complete, or other bytes
            if access.kind == HOST_READ and not write:
                continue  # a read beside a read
            assumed = access.union is not None and ordered(stamp, access.union)  # another host saw it complete
            (self.notes if assumed else self.hazards).append(
                self._host_hazard(access.kind, key, stamp, access.label, write, assumed=assumed))
        (self.copy_writes_host if write else self.copy_reads_host)(key, stamp, ranges)

    def _host_access(self, kind: str, key: Key, label: str, host: int, ranges: Ranges,
                     tables: tuple[dict[Key, list[_Pending]], ...]) -> None:
        vc = self.clocks.vc(host)
        for table in tables:
            pending = table.get(key)
            if not pending:
                continue
            kept: list[_Pending] = []
            for item in pending:
                if ordered(item.stamp, vc):
                    continue  # the thread has seen it complete: it can never conflict again
                if not overlaps(item.ranges, ranges):
                    kept.append(item)
                    continue
                writes = table is self._host_writers
                assumed = ordered(item.stamp, self.clocks.union)
                (self.notes if assumed else self.hazards).append(
                    self._host_hazard(kind, key, item.stamp, label, writes, assumed=assumed))
                # reported (or noted) once: the same pair is not reported again
            table[key] = kept

    def _host_hazard(self, kind: str, key: Key, stamp: OpStamp, label: str, copy_writes: bool, *,
                     assumed: bool = False) -> Hazard:
        resource = self.name(key)
        verb = "read" if kind == HOST_READ else "write"
        # (of or to, what the copy may not have done yet, why that matters, the upstream issue)
        to, done, why, issue = (("of", "written", "", " (the vLLM #36013 hazard)") if kind == HOST_READ else
                                ("to", "written", " (the copy would overwrite the host's bytes)", "") if copy_writes else
                                ("to", "read", "", " (the vLLM #48085 hazard)"))
        text = (f"host {verb} {to} {resource} by {label} while {stamp.label} may not have {done} it yet{why}: no "
                f"event or synchronisation observed by the host orders the copy before the {verb}{issue}")
        if assumed:
            text = (f"{text}; another host thread saw the copy complete first, and a hand-off the checker "
                    f"does not follow may order it")
        return Hazard(kind, resource, stamp.label, label, text, key)

    # -- events -------------------------------------------------------------------------------------
    def host_reads_event(self, key: Key, record: OpStamp, label: str, host: int = HOST) -> bool:
        """Host thread ``host`` reads what the device writes when it reaches ``record`` (an event's
        record: ``elapsed_time`` reads its time); a hazard unless the host has seen it complete.
        ``record`` stands for the point on its stream (``record.thread``, ``record.clock``): an event
        recorded on an idle stream (clock 0) is complete for everyone. Whether a hazard or a note was said."""
        if ordered(record, self.clocks.vc(host)):
            return False
        resource = self.name(key)
        text = (f"host read of {resource} by {label} while {record.label} may not have completed: no event or "
                f"synchronisation observed by the host orders the record before the read; CUDA answers "
                f"cudaErrorNotReady or the time, by timing")
        if ordered(record, self.clocks.union):
            self.notes.append(Hazard(EVENT_READ, resource, record.label, label,
                                     f"{text}; another host thread saw the event complete, and a hand-off the "
                                     f"checker does not follow may order it", key))
        else:
            self.hazards.append(Hazard(EVENT_READ, resource, record.label, label, text, key))
        return True

    # -- device memory ----------------------------------------------------------------------------
    def device_access(self, key: Key, stamp: OpStamp, *, write: bool, ranges: Ranges = None, late: bool = False) -> None:
        """``stamp`` reads or writes ``ranges`` of device resource ``key``; flag unordered conflicts.
        ``late``: declared after the host saw the op run (an indexed op's rows): what host threads
        have seen since says nothing of a hand-off at its enqueue, so no conflict becomes a note."""
        for other, verb, _, _ in self._shadows[key].access(ranges, stamp, write=write):
            mine = "writes" if write else "reads"
            first, second = (other, stamp) if other.seq <= stamp.seq else (stamp, other)  # in enqueue order
            first_verb, second_verb = (verb, mine) if first is other else (mine, verb)
            names = self.clocks.names
            resource = self.name(key)
            text = (f"{resource}: {first.label} {first_verb} it and {second.label} {second_verb} it with no event "
                    f"path between stream '{names[first.thread]}' and stream '{names[second.thread]}'")
            if not late and self.clocks.several_hosts and ordered(first, self.clocks.union):
                self.notes.append(Hazard(DEVICE, resource, first.label, second.label,
                                         f"{text}; another host thread saw the first access complete, and a "
                                         f"hand-off the checker does not follow may order them", key))
            else:
                self.hazards.append(Hazard(DEVICE, resource, first.label, second.label, text, key))


# -- pruning what can no longer race -------------------------------------------------------------------
def _all_seen(queued: tuple[int, ...], vc: tuple[int, ...] | list[int]) -> bool:
    """Whether ``vc`` orders every op counted in ``queued`` (each stream's clock) before it."""
    return all(clock <= seen for clock, seen in zip(queued, vc))


def _prune_seen(log: deque[_HostAccess], union: list[int]) -> None:
    """Drop the oldest accesses of ``log`` made after every op queued before them was seen complete
    by some host thread (each has run, so has declared what it touched). ``queued`` only grows along
    a log, so the first access that must stay ends the pruning."""
    while log and _all_seen(log[0].queued, union):
        log.popleft()


def _unsettled(pending: list[_Pending], union: list[int]) -> list[_Pending]:
    """The pending copies that a host access may still have to be reported against, in their order.

    Dropped: those some host thread has seen complete (another thread's access is a note, never a
    race), and those whose bytes the later copies on their stream cover. A later copy on the same
    stream runs after it, so a host thread that has not seen it complete has not seen them either,
    and an access to its bytes meets one of them: the access is still reported, against the newest
    copy, which may not have run yet either. A loop that copies one buffer keeps one copy per stream."""
    covered: dict[int, Ranges] = {}  # stream -> the bytes of the later copies kept (None: all)
    keep = [False] * len(pending)
    for i in sorted(range(len(pending)), key=lambda i: pending[i].stamp.clock, reverse=True):
        item = pending[i]
        if ordered(item.stamp, union):
            continue
        cover = covered.get(item.stamp.thread, [])
        if _covers(cover, item.ranges):
            continue
        keep[i] = True
        covered[item.stamp.thread] = None if cover is None or item.ranges is None else merge(cover + item.ranges)
    return [item for item, kept in zip(pending, keep) if kept]


def _covers(cover: Ranges, ranges: Ranges) -> bool:
    """Whether ``cover`` (merged runs, None: all) holds every byte of ``ranges`` (None: all)."""
    if cover is None:
        return True
    if ranges is None:
        return False
    starts = [start for start, _ in cover]
    for start, end in ranges:
        if start >= end:
            continue
        i = bisect.bisect_right(starts, start) - 1
        if i < 0 or cover[i][1] < end:
            return False
    return True
