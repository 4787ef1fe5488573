"""The GPU observer: the sanitizer's state for one process, and the glue between its windows.

The observer is a :class:`~sanitizer.watch.HostWatch` (pinned memory, host accesses, threads,
races) with a device side of its own: streams named by where they were made, events carrying their
stream's clock, device memory keyed by allocation and reused by the caching allocator's rule, and
force mode's gates. Its windows (:mod:`sanitizer.gpu.dispatch`, :mod:`.trace`, :mod:`.patches`)
call the methods here, always under :attr:`lock` (several host threads may be at work).

Verdicts come from enqueue order, never from timing: a race is reported on a run where the values
came out right. Force mode (:mod:`sanitizer.gpu.forcing`) can also make them come out wrong.

Stepping aside. kvzero's own fuzz harness runs zeroers on CUDA with gate kernels that hold streams
on flags the host writes, an order no torch hook shows; it announces its runtimes through
:mod:`racecheck.schedules`, and the observer checks nothing from the first one's start to the last
one's close (the harness checks that work itself, with the same checker).

Example (needs a GPU)::

    obs = Observer()
    obs.start()
    main()                      # the program
    races = obs.stop()
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from racecheck import schedules
from racecheck.device_values import DeviceValues
from racecheck.hb import HappensBefore, OpStamp
from racecheck.pinned import PinnedWatch, Region, Snapshot
from racecheck.ranges import byte_runs
from racecheck.threads import HostThreads
from sanitizer.gpu.device import CudaDevice
from sanitizer.races import HANDED_OUT_AGAIN, Access, Label, Race, Unfollowed
from sanitizer.sites import Site, caller_site
from sanitizer.watch import HostWatch

_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)
GC_THRESHOLD = 20_000  # allocations between young collections while an observer runs (Python's default: 700)


class Observer(HostWatch):
    """The sanitizer's state for one process; see the module docstring."""

    device_key = "cudamem"  # device memory's key: ("cudamem", address); labels count its generations

    def __init__(self, *, forcing: Any = None, device: Any = None) -> None:
        hb = HappensBefore()
        threads = HostThreads(hb)
        super().__init__(hb, threads, PinnedWatch(hb, threads.current))
        self.device = device if device is not None else CudaDevice()
        self.forcing = forcing  # sanitizer.gpu.forcing.Forcing in force mode, else None
        self.unfollowed: list[Unfollowed] = []
        self._own = threading.local()  # per thread: the sanitizer's own CUDA work (gates, an index read) under way
        self._schedules = 0  # runtimes with a schedule of their own are running (racecheck.schedules)
        self._streams: dict[int, int] = {}  # cudaStream_t -> checker thread
        self._stream_names: dict[int, str] = {}
        self._events: dict[int, OpStamp] = {}  # cudaEvent_t -> its last record's stamp (its clock, its line)
        self._alloc_stream: dict[int, int] = {}  # device address -> stream it was last handed out on
        self._generation: dict[int, int] = {}  # device address -> how many times it was handed out
        self._recorded: set[int] = set()  # device addresses record_stream tied to another stream
        self._device_sites: dict[int, Site] = {}  # device address -> where it was last handed out
        self._named: dict[int, tuple[str, int]] = {}  # device address -> its checker key, once named
        # Pinned regions accessed through raw addresses, by id; one leaves when a new region takes its memory.
        self._raw_pinned: dict[int, Region] = {}
        # Of those, the clocks of torch's own copies made after a raw access: the allocator waits for them.
        self._allocator_waits: dict[int, tuple[int, ...]] = {}
        self._accesses: dict[tuple, Access] = {}
        self._ops = 0
        self._started = False
        self._teardown = contextlib.ExitStack()  # what start() did, undone by stop()
        from sanitizer.gpu.graphs import Graphs
        from sanitizer.gpu.indices import Indices

        self.graphs = Graphs(self)
        # The values of small integer tensors in device memory, shadowed as the program makes them
        # (racecheck.device_values): tables and indices, known without reading the device.
        self.values = DeviceValues(self.device.is_device)
        self.indices = Indices(self)

    @property
    def paused(self) -> bool:
        """Whether what happens now is not this observer's to check: the sanitizer's own work, a
        runtime with a schedule of its own (module docstring), or an observer started inside this
        one (a test of the sanitizer, run under the sanitizer), which checks instead."""
        return self._schedules > 0 or getattr(self._own, "busy", 0) > 0 or _RUNNING[-1] is not self

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        from racecheck import custom_ops
        from sanitizer.gpu import custom, dispatch, patches, trace

        # Each step's undo is pushed before the step can leave anything behind: stop() runs them in
        # reverse, and a step that raises here undoes the steps before it (no patch outlives a
        # failed start, and a test that fails later leaves nothing installed once it stops).
        teardown = self._teardown
        try:
            if self.forcing is not None:
                teardown.callback(self.forcing.close)
            teardown.callback(trace.uninstall, self)
            # torch imports its compiler stack on the first op through a Python dispatch mode unless the
            # mode opts out (dispatch.Ops does); nothing here needs torch._dynamo.
            trace.install(self)
            teardown.callback(patches.install(self))
            teardown.callback(schedules.subscribe(self._schedule_started, self._schedule_ended))
            teardown.callback(self.deactivate_host_hooks)
            self.activate_host_hooks()
            # Custom ops' and pybind functions' effect models, routed here; stand-ins only for the names
            # nothing of the program's answers to (racecheck.custom_ops).
            teardown.enter_context(custom_ops.routing(custom.router(self)))
            teardown.enter_context(custom_ops.extension_modules())
            teardown.callback(dispatch.enter(self))
            self.mark_set_up()
            teardown.callback(_not_running, self)
            self._started = True
            _RUNNING.append(self)
            _collector_relaxed(True)
        except BaseException:
            self._started = False
            teardown.close()
            raise

    def stop(self) -> list[Race]:
        """Stop observing; the races seen (a final host check and the forced releases first)."""
        try:
            self.scope_end(caller_site())
        finally:
            self._started = False
            self._teardown.close()  # every step of start() undone, in reverse, whatever one of them raises
        return self.races

    def _setup_thread(self) -> Callable[[], None] | None:
        """A thread the program started: the dispatch mode is entered in it (modes are per thread)."""
        from sanitizer.gpu import dispatch

        return dispatch.enter(self)

    def scope_end(self, site: Site) -> None:
        """:meth:`HostWatch.scope_end`, what force mode holds released and the indexed ops resolved."""
        with self.lock:
            self.boundary(site)
            self.release_forced(site)
            self.indices.finish()
            self.collect()

    def take_unfollowed(self) -> list[Unfollowed]:
        notes, self.unfollowed = self.unfollowed, []
        return notes

    @contextlib.contextmanager
    def own_work(self) -> Iterator[None]:
        """A scope of the sanitizer's own CUDA work, which no window may take for the program's."""
        own = self._own
        own.busy = getattr(own, "busy", 0) + 1
        try:
            yield
        finally:
            own.busy -= 1

    # -- streams and labels ------------------------------------------------------------------------
    def stream_thread(self, stream: int) -> int:
        thread = self._streams.get(stream)
        if thread is None:
            name = self._stream_names.get(stream) or (
                "the default stream" if stream == 0 else f"stream 0x{stream:x}")
            self._stream_names[stream] = name
            thread = self._streams[stream] = self.hb.add_stream(name)
        return thread

    def label(self, what: str, stream: int, site: Site | None) -> Label:
        self._ops += 1
        if stream not in self._stream_names:
            self.stream_thread(stream)
        # by the site's identity: one Site per program line (sanitizer.sites), kept alive by its Access
        key = (what, stream, id(site))
        access = self._accesses.get(key)
        if access is None:  # one Access per op, stream and line: a loop's ops share it
            if len(self._accesses) > 65536:
                self._accesses.clear()
            access = self._accesses[key] = Access(what, self._stream_names[stream], site)
        return Label.of(f"{what}#{self._ops}", access)

    def enqueue(self, what: str, stream: int, site: Site | None) -> OpStamp:
        """Stamp an op the calling thread enqueues on ``stream``."""
        return self.hb.enqueue(self.stream_thread(stream), self.label(what, stream, site), self.threads.current())

    def event_time_read(self, events: tuple, site: Site) -> None:
        """``start.elapsed_time(end)`` at ``site`` (``events``: the two torch events): a host read of
        their times (:meth:`HostWatch.event_times_read`)."""
        handles = [self.device.event_handle(event) for event in events]
        self.event_times_read([self._events.get(h) if h is not None else None for h in handles], site)

    def observes_stream(self, stream: int) -> None:
        """The calling thread waited for everything queued on ``stream``."""
        self.hb.host_observes_stream(self.stream_thread(stream), self.threads.current())

    # -- device memory -----------------------------------------------------------------------------
    def device_access(self, tensor: torch.Tensor, stamp: OpStamp, *, write: bool,
                      ranges: list[tuple[int, int]] | None = None, late: bool = False) -> None:
        """``stamp`` reads or writes ``tensor``'s bytes (``ranges`` of them, where known)."""
        address = tensor.untyped_storage().data_ptr()
        self.device_access_at(address, byte_runs(tensor) if ranges is None else ranges, stamp, write=write, late=late)

    def device_access_at(self, address: int, ranges: list[tuple[int, int]], stamp: OpStamp, *, write: bool,
                         late: bool = False) -> None:
        """``stamp`` reads or writes ``ranges`` of the device allocation at ``address``."""
        if address == 0:
            return  # an empty tensor: no memory
        label = stamp.label
        if isinstance(label, Label):
            label.generations[address] = self._generation.get(address, 0)
        key = self._named.get(address)
        if key is None:  # one key per allocation, made once (an op touches a few of them)
            key = self._named[address] = ("cudamem", address)
            self.hb.name_resource(key, f"device memory at 0x{address:x}")
        self.hb.device_access(key, stamp, write=write, ranges=ranges, late=late)
        if write:
            self.values.written(address, ranges)
            self.indices.written(address)

    def memory_allocated(self, address: int) -> None:
        """The caching allocator handed ``address`` out. It reuses memory on the stream that freed it
        without waiting for other streams, unless ``record_stream`` tied the block to them (then it
        waited for their events): only in that case, or when the block came back through CUDA on
        another stream (a device synchronisation), does the address start a fresh history."""
        stream = self.device.current_stream(None)
        previous = self._alloc_stream.get(address)
        if address in self._recorded or (previous is not None and previous != stream):
            self.hb.forget(("cudamem", address))
            self._recorded.discard(address)
        self._alloc_stream[address] = stream
        self._generation[address] = self._generation.get(address, 0) + 1
        self.values.written(address)  # fresh memory: nothing of it is known
        # The op that allocates is the one the dispatch mode is handling: its line, without a walk.
        self._device_sites[address] = self.last_site or caller_site()

    def stream_recorded(self, tensor: torch.Tensor) -> None:
        """``tensor.record_stream(s)``: its block waits for ``s`` before the allocator reuses it."""
        self._recorded.add(tensor.untyped_storage().data_ptr())

    def cache_emptied(self) -> None:
        """``torch.cuda.empty_cache()``: freed blocks go back to CUDA, which reuses them only after a
        device synchronisation; every device address starts a fresh history."""
        self.hb.host_observes_all(self.threads.current())
        for address in list(self._alloc_stream):
            self.hb.forget(("cudamem", address))
        self._alloc_stream.clear()

    # -- pinned memory -----------------------------------------------------------------------------
    def region_of(self, tensor: torch.Tensor) -> Region | None:
        """The pinned region ``tensor`` lives in: known, or pinned before the sanitizer started."""
        region = self.pinned.lookup(tensor)
        if region is None and self.device.is_pinned(tensor):
            region = self.note_pinned(tensor, None, "allocated before the sanitizer started")
        return region

    def note_pinned(self, tensor: torch.Tensor, site: Site | None, how: str) -> Region:
        with _disable_current_modes():
            shape, dtype = tuple(tensor.shape), str(tensor.dtype).replace("torch.", "")
            storage = tensor.untyped_storage()
            start = storage.data_ptr()
            end = start + max(storage.nbytes(), 1)
        if site is not None:  # an allocation seen made (one found lazily may be a view over older memory)
            self._handed_out_again(start, end, site, how)
        region = self.pinned.register(tensor, keep=False, site=site)
        self.pinned.rename(region, f"pinned host buffer {shape} {dtype} ({how})")
        self._numpy_at.pop(region.id, None)
        return region

    def raw_pinned_access(self, region: Region, stamp: OpStamp, runs: list[tuple[int, int]], *, write: bool) -> None:
        """``stamp`` reads or writes ``runs`` of pinned ``region`` through a raw address (an extension's
        op, a Triton kernel, a driver copy). torch's caching host allocator records an event on a
        block only for torch's own copies of it, and waits for those before it hands the block out
        again; a raw access it never hears of, so a block the program drops under one goes to the
        next pinned allocation at once (LMCache #4830). These accesses are kept under a key of their
        own, checked when the block comes back (:meth:`_handed_out_again`)."""
        if region.registered:
            return  # cudaHostRegister'ed memory: the program's own, never recycled by the allocator
        key = ("pinned-raw", region.id)
        if region.id not in self._raw_pinned:
            self.hb.name_resource(key, region.name or f"pinned host buffer p{region.id}")
        self._raw_pinned[region.id] = region
        (self.hb.copy_writes_host if write else self.hb.copy_reads_host)(key, stamp, runs)

    def torch_copied_pinned(self, region: Region, stamp: OpStamp) -> None:
        """``stamp`` is torch's own non-blocking copy of pinned ``region``: the caching host allocator
        records an event behind it (CachingHostAllocator_recordEvent) and hands the block out again
        only once that event has completed, so a raw access ordered before the copy has completed
        too when the block comes back. Kept only for blocks raw accesses used."""
        if region.id not in self._raw_pinned:
            return
        waits = self._allocator_waits.get(region.id, ())
        self._allocator_waits[region.id] = tuple(map(max, itertools.zip_longest(waits, stamp.vc, fillvalue=0)))

    def _handed_out_again(self, start: int, end: int, site: Site | None, how: str) -> None:
        """A pinned allocation took ``[start, end)``: a block an earlier tenant's raw accesses used is
        written by the host now (its new tenant's), checked against those still pending (the
        simulator's model of the allocator says the same: sanitizer.sim.session)."""
        if not self._raw_pinned:
            return
        for old in self.pinned.regions.overlapping(start, end):
            if self._raw_pinned.pop(old.id, None) is None:
                continue
            host = self.threads.current()
            # the allocator saw the events behind torch's own copies of the block complete
            self.hb.host_observes(self._allocator_waits.pop(old.id, None), host)
            what = f"{HANDED_OUT_AGAIN} ({how})"
            self.hb.host_write(("pinned-raw", old.id), self.host_label(what, site, reused=True), host,
                               [(max(start, old.start), min(end, old.end))])
        self.collect()

    def queued_read(self, region: Region, view: torch.Tensor, stamp: OpStamp, held: Any, keep: Any = None) -> None:
        """``stamp`` (a copy, a kernel) reads ``view`` of pinned ``region`` when it runs: a snapshot of
        its bytes now, watched by force mode's gate ``held`` (``keep``: what keeps the memory alive
        meanwhile; by default an alias of the sanitizer's own, so the host allocator cannot recycle it)."""
        if keep is None:
            with torch._C.DisableTorchFunction():
                keep = view.detach()
        snapshot = self.pinned.note_read(region, view, stamp, keep=keep)
        if held is not None and snapshot is not None:
            held.reads.append(snapshot)

    def queued_write(self, region: Region, view: torch.Tensor, stamp: OpStamp, held: Any) -> None:
        """``stamp`` (a device-to-host copy, a kernel storing into pinned memory) writes ``view`` of
        ``region`` when it runs: pending until the host has seen it, watched by force mode's ``held``."""
        self.pinned.note_device_write(region, view, stamp)
        if held is not None:
            held.writes.append((region, stamp.label.access))

    def register_host_range(self, address: int, nbytes: int, site: Site) -> None:
        """``cudaHostRegister(address, nbytes)``: pinned memory outside the caching allocator."""
        region = self.pinned.register_range(address, nbytes, site=site)
        self.pinned.rename(region, f"host memory registered with cudaHostRegister ({nbytes} bytes)")

    def _gone(self, snapshot: Snapshot) -> bool:
        """Whether nothing but the snapshot holds the buffer: the program cannot write it any more."""
        keep = snapshot.keep
        if _USE_COUNT is None or not isinstance(keep, torch.Tensor):
            return False
        return _USE_COUNT(keep.untyped_storage()._cdata) <= 2  # our alias and the temporary storage

    # -- force mode --------------------------------------------------------------------------------
    def hold(self, index: int | None) -> Any:
        """A closed gate on the calling thread's current stream (force mode), or None."""
        if self.forcing is None:
            return None
        with self.own_work():
            return self.forcing.hold(self.device.stream_object(index))

    def release_forced(self, site: Site | None) -> None:
        """The host is about to wait for the GPU: every gate opens first (and the values the held
        copies are about to read are compared with what was staged)."""
        if self.forcing is None or not self.forcing.holding:
            return
        with self.own_work():
            for snapshot, delivered in self.forcing.release(site):
                self._forced_values(snapshot, delivered)

    def _forced_values(self, snapshot: Snapshot, delivered: Any) -> None:
        from sanitizer.gpu.forcing import shown_values

        label = snapshot.stamp.label
        access = getattr(label, "access", None)
        if access is None:
            return
        dtype = snapshot.dtype
        text = (f"{access.what} read {shown_values(delivered, dtype)} where "
                f"{shown_values(snapshot.values(), dtype)} was staged when it was queued")
        for i, race in enumerate(self.races):
            if race.kind == "host-write-vs-pending-copy" and race.queued is access and not race.values:
                self.races[i] = replace(race, values=text)

    # -- runtimes with a schedule of their own (racecheck.schedules) ---------------------------------
    def _schedule_started(self, runtime: Any, what: str) -> None:
        with self.lock:
            if not self._schedules:
                self.unfollowed.append(Unfollowed(
                    f"{what} (it orders streams with gate kernels no hook sees); checking resumes when it "
                    f"closes", caller_site()))
            self._schedules += 1

    def _schedule_ended(self, runtime: Any) -> None:
        with self.lock:
            self._schedules = max(0, self._schedules - 1)
            if not self._schedules:
                # Resume with everything before counted as seen by the host (a runtime synchronises
                # when it closes), so nothing it did is later taken for a race.
                self.pinned.pending = type(self.pinned.pending)()
                self.hb.host_observes_all(self.threads.current())

    # -- results -----------------------------------------------------------------------------------
    def allocated_at(self, hazard: Any) -> Site | None:
        address = _address_of(hazard)
        if address is not None:
            return self._device_sites.get(address)
        return super().allocated_at(hazard)


_RUNNING: list[Any] = [None]  # the observers started and not stopped, innermost last


def running_observers() -> list[Observer]:
    """The observers started and not stopped yet, innermost last."""
    return [obs for obs in _RUNNING if obs is not None]


def _not_running(obs: Observer) -> None:
    """``obs`` stopped: the collector's thresholds go back once no observer runs, in whatever order they stop."""
    if obs in _RUNNING:
        _RUNNING.remove(obs)
    _collector_relaxed(len(_RUNNING) > 1)


def races_so_far() -> list[Race]:
    """The races every observer still running has seen (a copy, read without stopping them): what a
    command ended by force still reports (racecheck.interrupts)."""
    return [race for obs in running_observers() for race in list(obs.races)]


_SAVED_THRESHOLDS: list[tuple[int, ...]] = []  # the collector's thresholds before the first observer ran


def _collector_relaxed(relaxed: bool) -> None:
    """While any observer runs, the cyclic collector's first threshold is raised: the checker keeps a
    stamp, a label and shadow state per op, and the collector walked all of it every few hundred
    allocations (a sixth of the per-op cost of a launch-bound test on the CUDA stand-in). Put back
    as it was once the last observer has stopped."""
    if relaxed and not _SAVED_THRESHOLDS:
        _SAVED_THRESHOLDS.append(gc.get_threshold())
        saved = _SAVED_THRESHOLDS[0]
        gc.set_threshold(max(saved[0], GC_THRESHOLD), *saved[1:])
    elif not relaxed and _SAVED_THRESHOLDS:
        gc.set_threshold(*_SAVED_THRESHOLDS.pop())


def _address_of(hazard: Any) -> int | None:
    """The device allocation a hazard is on (its key is ``("cudamem", address)``), else None."""
    key = hazard.key
    return key[1] if isinstance(key, tuple) and len(key) == 2 and key[0] == "cudamem" else None