"""The host side of a sanitized run, the same on the GPU and on the simulator.

Whatever runs the program's device work (the GPU observer, or the simulator), the host side is the
same: pinned memory and the copies pending on it (:class:`racecheck.pinned.PinnedWatch`), host
accesses that a call shows (a torch op on pinned memory, a :class:`~sanitizer.numpy_views.WatchedArray`)
and those only a changed snapshot reveals, host threads and the hand-offs between them
(:mod:`racecheck.thread_hooks`), and the checker's hazards turned into :class:`~sanitizer.races.Race`
records. :class:`HostWatch` holds it; each backend subclasses it with what is its own (how ops are
seen and stamped, what a thread needs set up).

A host write that no call showed is placed between two program lines: the last boundary of the
thread that found it (an op, a trace callback, a scope's end) and this one, or at the line that
took the numpy view it most likely went through. Only the program's threads look for such writes:
the one that made the watch, those started under it, and any other once the program ran an op on
it. A bystander (pytest-xdist's receiver thread, a library's own) that only hands something off
records the hand-off and nothing more: it would otherwise be named the writer, at its own line.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from kvdevice.origin import forwarding
from racecheck.hb import HOST_READ, HOST_WRITE, HappensBefore, Hazard, OpStamp
from racecheck.pinned import PinnedWatch, Region, Snapshot
from racecheck.ranges import Runs, clip
from racecheck.threads import HostThreads
from sanitizer import numpy_views
from racecheck import thread_hooks
from sanitizer.host_ops import pinned_access
from sanitizer.races import Access, Label, Race
from sanitizer.sites import Site, caller_site


QUICK_EVERY = 8  # a device op's boundary compares the snapshots every this many ops


class HostWatch:
    """See the module docstring. ``hb``, ``threads`` and ``pinned`` are the backend's."""

    device_key = ""  # the first part of the checker's keys of device memory (the second: what generations count)

    def __init__(self, hb: HappensBefore, threads: HostThreads, pinned: PinnedWatch) -> None:
        self.hb = hb
        self.threads = threads
        self.pinned = pinned
        self.lock = threading.RLock()
        self.handoffs = thread_hooks.HandOffs(hb, threads)
        self.races: list[Race] = []
        self.notes: list[str] = []
        self._noted: set[tuple] = set()
        self._hazards_seen = 0
        self._notes_seen = 0
        self._local = threading.local()  # per thread: the last boundary's site
        self._numpy_at: dict[int, Site] = {}  # region id -> where its numpy view was last taken
        self._undo: list[Callable[[], None]] = []
        self._quick = 0  # quick boundaries since the last comparison
        self._local.program = True  # the thread that made the watch is the program's

    # -- life -------------------------------------------------------------------------------------
    def activate_host_hooks(self) -> None:
        """Watched numpy views and followed threads report here until :meth:`deactivate_host_hooks`."""
        self._undo.append(numpy_views.activate(self))
        self._undo.append(thread_hooks.activate(self))

    def deactivate_host_hooks(self) -> None:
        while self._undo:
            self._undo.pop()()

    # -- sites --------------------------------------------------------------------------------------
    @property
    def last_site(self) -> Site | None:
        return getattr(self._local, "site", None)

    @last_site.setter
    def last_site(self, site: Site | None) -> None:
        self._local.site = site

    # -- pinned memory ------------------------------------------------------------------------------
    def host_label(self, what: str, site: Site | None, until: Site | None = None, *, reused: bool = False) -> Label:
        return Label.of(what, Access(what, "the host", site, until=until, reused=reused))

    def boundary(self, site: Site, *, quick: bool = False) -> None:
        """The host reached ``site`` (an op, a callback, a scope's end): host writes since the last
        boundary that no call showed are found by the snapshots and placed in between. A ``quick``
        boundary (a device op: the most frequent) compares only every :data:`QUICK_EVERY`-th time;
        one that does not compare leaves the window open, so a write found later is still placed
        between two lines that hold it (every synchronisation compares, so none is missed).
        The calling thread is the program's from now on."""
        self._local.program = True
        if quick and self.pinned.pending:
            self._quick += 1
            if self._quick < QUICK_EVERY:
                return
        self._quick = 0
        if self.pinned.pending:
            found = self.pinned.changed(self._gone)
            if found:
                host = self.threads.current()
                for snapshot in found:
                    self.hb.host_write(snapshot.region.key, self._unseen_write(snapshot, site), host, snapshot.runs)
                self.collect()
        self.last_site = site

    def handoff_boundary(self, site: Site) -> None:
        """A thread hands something off (or starts a thread) at ``site``: a boundary if it is the
        program's thread; a bystander's hand-off compares nothing (module docstring)."""
        if getattr(self._local, "program", False):
            self.boundary(site)

    def _gone(self, snapshot: Snapshot) -> bool:
        """Whether nothing but the snapshot holds the memory any more (the backend may know)."""
        return False

    def _unseen_write(self, snapshot: Snapshot, site: Site) -> Label:
        numpy_site = self._numpy_at.get(snapshot.region.id)
        if numpy_site is not None:
            return self.host_label("host write through the buffer's numpy view", numpy_site, until=site)
        return self.host_label("host write", self.last_site or site, until=site)

    # -- the host hooks both backends call (the GPU's patches, the simulator's modes) ----------------
    def numpy_taken(self, tensor: torch.Tensor, array: Any, site: Site) -> Any:
        """``tensor.numpy()`` returned ``array`` at ``site``: a pinned tensor's view is watched (its
        writes are host writes), any other's is handed back as it is."""
        with self.lock:
            region = self.region_of(tensor)
            if region is None:
                return array
            self.boundary(site)
            self._numpy_at[region.id] = site
        return numpy_views.watched(array)

    def tolist_read(self, tensor: torch.Tensor, site: Site) -> None:
        """``tensor.tolist()`` at ``site``: a host read of its bytes, if they are pinned."""
        if not self.pinned.regions:
            return
        with self.lock:
            self.boundary(site)
            self.host_access(tensor, write=False, what="host read (.tolist() of the pinned buffer)", site=site)

    @forwarding  # the program's own op, run here: what torch raises under it is the program's
    def host_op(self, func: Any, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> Any:
        """An aten op on host tensors: its reads and writes of pinned memory are host accesses,
        checked against the copies pending on those bytes (:mod:`sanitizer.host_ops`); then it runs."""
        site = pinned_access(self, func, args, kwargs, tensors)
        result = func(*args, **kwargs)
        if site is not None:
            self.last_site = site
        return result

    def region_of(self, tensor: torch.Tensor) -> Region | None:
        """The pinned region ``tensor`` lives in (a backend may also find memory pinned before it started)."""
        return self.pinned.lookup(tensor)

    def host_access(self, tensor: torch.Tensor, *, write: bool, what: str, site: Site, reused: bool = False) -> bool:
        """A call the sanitizer sees reads or writes ``tensor`` on the host; whether it is pinned.
        ``reused``: the write is the caching host allocator handing the bytes out again."""
        region = self.region_of(tensor)
        if region is None:
            return False
        label = self.host_label(what, site, reused=reused)
        (self.pinned.host_write if write else self.pinned.host_read)(region, tensor, label)
        self.collect()
        return True

    def numpy_access(self, runs: Runs, *, write: bool, what: str, site: Site) -> None:
        """A :class:`~sanitizer.numpy_views.WatchedArray` read or wrote ``runs`` at ``site``."""
        if not runs:
            return
        with self.lock:
            region = self.pinned.regions.find(runs[0][0])
            if region is None:
                return
            if write:
                self.boundary(site)  # what changed before this line is not this line's write
            self.pinned.host_access_runs(region, clip(runs, region.start, region.end), self.host_label(what, site),
                                         write=write)
            self.collect()

    # -- events ---------------------------------------------------------------------------------------
    def event_times_read(self, records: list[OpStamp | None], site: Site) -> None:
        """``start.elapsed_time(end)`` at ``site``, called under the lock: the host reads the times the
        device wrote when it reached the two records (``records``: start's, end's; None for an event
        recorded outside the watch). The end event is checked first and one race said per call: timing a
        job claims its end has completed (a transfer reported finished before its end event was seen)."""
        hb = self.hb
        host = self.threads.current()
        for which, record in reversed(list(zip(("start", "end"), records))):
            if record is None:
                continue
            label = self.host_label(f"elapsed_time (the {which} event's time)", site)  # which one was pending
            key = ("event time", record.thread)  # one name per stream, however many records
            hb.name_resource(key, f"the time of an event recorded on {record.label.access.stream}")
            if hb.host_reads_event(key, record, label, host):
                break
        self.collect()

    # -- threads (racecheck.thread_hooks.ThreadWatch) -----------------------------------------------------
    def thread_starting(self, thread: threading.Thread) -> Any:
        """``thread.start()`` is being called: what the starter knows now is what the thread knows."""
        with self.lock:
            self.handoff_boundary(caller_site())
            return self.hb.host_snapshot(self.threads.current())

    def thread_running(self, thread: threading.Thread, token: Any) -> Callable[[], None]:
        with self.lock:
            self.threads.started_from(token, threading.get_ident(), thread.name, thread)
        self._local.program = True  # started under the watch
        teardown = self.thread_setup()

        def finish() -> None:
            try:
                with self.lock:
                    self.boundary(caller_site())
                    self.handoffs.release(thread)
            finally:
                if teardown is not None:
                    teardown()
                self.threads.ended(threading.get_ident())

        return finish

    def thread_setup(self) -> Callable[[], None] | None:
        """Set the calling thread up for the program's code, once (the backend's modes: they are
        per thread in torch); the function that undoes it, or None when it was set up already."""
        if getattr(self._local, "set_up", False):
            return None
        undo = self._setup_thread()
        self._local.set_up = True

        def teardown() -> None:
            self._local.set_up = False
            if undo is not None:
                undo()

        return teardown

    def mark_set_up(self) -> None:
        """The calling thread is set up already (the one that started the sanitizer)."""
        self._local.set_up = True

    def _setup_thread(self) -> Callable[[], None] | None:
        return None

    def release(self, obj: Any) -> None:
        with self.lock:
            self.handoff_boundary(caller_site())
            self.handoffs.release(obj)

    def acquire(self, obj: Any) -> None:
        with self.lock:
            self.handoffs.acquire(obj)
            self.last_site = caller_site()

    # -- results ------------------------------------------------------------------------------------
    def scope_end(self, site: Site) -> None:
        """A test (or the program) ended at ``site``: the host is checked once more."""
        with self.lock:
            self.boundary(site)
            self.collect()

    def take_races(self) -> list[Race]:
        races, self.races = self.races, []
        return races

    def take_notes(self) -> list[str]:
        notes, self.notes = self.notes, []
        return notes

    def access_of(self, label: str) -> Access | None:
        return getattr(label, "access", None)

    def collect(self) -> None:
        """Turn the checker's new hazards into races, and its new notes into one line each."""
        hazards = self.hb.hazards
        while self._hazards_seen < len(hazards):
            race = self.race_of(hazards[self._hazards_seen])
            if race is not None:
                self.races.append(race)
            self._hazards_seen += 1
        if len(hazards) > 1024:  # keep the checker's list short: its hazards are races already
            del hazards[:]
            self._hazards_seen = 0
        notes = self.hb.notes
        while self._notes_seen < len(notes):
            self._note(notes[self._notes_seen])
            self._notes_seen += 1

    def race_of(self, hazard: Hazard) -> Race | None:
        first, second = self.access_of(hazard.first), self.access_of(hazard.second)
        if first is None or second is None:
            return None
        return Race(self.kind_of(hazard), hazard.resource, self.allocated_at(hazard), first, second)

    def kind_of(self, hazard: Hazard) -> str:
        """``reuse-without-record-stream`` where two streams touched device memory (a key of
        :attr:`device_key`) in two of its allocations (their labels' generations differ)."""
        key = hazard.key
        if hazard.kind == "unordered-device-access" and isinstance(key, tuple) and key[:1] == (self.device_key,):
            first = getattr(hazard.first, "generations", {}).get(key[1])
            second = getattr(hazard.second, "generations", {}).get(key[1])
            if first is not None and second is not None and first != second:
                return "reuse-without-record-stream"
        return hazard.kind

    def allocated_at(self, hazard: Hazard) -> Site | None:
        for region in self.pinned.regions.regions():
            if region.key == hazard.key:
                return region.site
        return None

    def _note(self, hazard: Hazard) -> None:
        first, second = self.access_of(hazard.first), self.access_of(hazard.second)
        if first is None or second is None:
            return
        key = (hazard.kind, first.site, second.site)
        if key in self._noted:
            return
        self._noted.add(key)
        side = {HOST_WRITE: "host write", HOST_READ: "host read"}.get(hazard.kind, "access")
        self.notes.append(
            f"kvz-sanitize assumed an order it cannot see: the {side} {second.where()} ({second.stream}) "
            f"follows {first.what} {first.where()} only through another thread that saw it complete and a "
            f"hand-off not followed (a lock, a flag); use a queue.Queue, threading.Event or an event "
            f"synchronize() in this thread to make the order visible")
