"""A whole program on the simulator: an intercept session whose labels are program lines.

:class:`ProgramSession` is the fuzzer's :class:`~kvdevice.intercept.session.InterceptSession` with
what a program's report needs and a zeroer's does not:

* every queued op is labelled with the program line that issued it, and its stream with the line
  that made it (``stream 1 (created at prog.py:12)``);
* pinned memory is named like the GPU names it and remembers where it was allocated; host memory
  registered with ``cudaHostRegister`` is pinned memory (:mod:`.device_api`);
* host reads and writes of pinned memory are seen where a call shows them: torch ops on the CPU
  tensor (a dispatch mode, :mod:`sanitizer.host_ops`), ``.tolist()``, numpy views
  (:mod:`sanitizer.numpy_views`); the rest by the snapshots, at the next call;
* CUDA graphs are captured and replayed (:mod:`kvdevice.intercept.sim_graphs`);
* a host that polls an event or a stream gets there, as on a GPU: a query that finds it not done
  answers False and lets the work up to it run before the next query of it (:meth:`query_event`);
* every thread the program starts runs under the session (its modes are entered in it; each
  thread has its own current stream and host clock, :mod:`racecheck.thread_hooks`); one lock makes each
  intercepted call whole, whichever thread makes it.

The host side (hazards into races, notes, hand-offs) is :class:`~sanitizer.watch.HostWatch`'s, the
same the GPU observer uses.

Example::

    races, error, notes, unfollowed = simulate(program.main)    # races: [Race(...)] on a racy program
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from racecheck.hb import OpStamp
from racecheck.pinned import Region
from sanitizer.dynamo_guard import SanitizerMode
from sanitizer.host_ops import tensors_of
from sanitizer.races import HANDED_OUT_AGAIN, Access, Label, Race
from sanitizer.sites import Site, also_skip, caller_site
from sanitizer.watch import HostWatch
from kvdevice.intercept.host_memory import HostMemory
from kvdevice.intercept.session import InterceptSession
from kvdevice.runtime.op_origin import PROGRAM
from kvdevice.intercept.sim_graphs import SimGraphs, graph_classes
from kvdevice.intercept.sim_tensor import SimCudaTensor
from kvdevice.intercept.torch_mode import InterceptMode
from kvdevice.origin import blame, forwarding
from kvdevice.runtime import make_runtime

KEPT_GENERATIONS = 8  # a block's allocation lines kept (races are collected within a few of its reuses)


class ProgramHostMemory(HostMemory):
    """Pinned memory named as the GPU observer names it, with the line that allocated it; torch's
    pinned allocations come from the model of its caching host allocator (``caching``)."""

    caching = True

    def register(self, tensor: torch.Tensor, origin: str = "", site: Any = None, **details: Any) -> Region:
        return super().register(tensor, origin, site if site is not None else caller_site(), **details)

    def _name(self, region: Region) -> None:
        base = region.base
        if region.layout:
            self.rename(region, f"pinned host buffer {region.layout} ({region.origin})")
            return
        if region.registered or base is None:
            self.rename(region, f"host memory registered with cudaHostRegister ({region.end - region.start} bytes)")
            return
        with torch._C.DisableTorchFunction():
            shape, dtype = tuple(base.shape), str(base.dtype).replace("torch.", "")
        self.rename(region, f"pinned host buffer {shape} {dtype} ({region.origin})")


class ProgramSession(InterceptSession):
    """See the module docstring. ``name`` is the program (or the test) in messages."""

    host_memory_class = ProgramHostMemory
    helper_threads_class = None  # a program's threads run free under one lock (racecheck.thread_hooks)
    kernel_arguments_by_bytes = True  # a kernel over the whole KV cache touches the blocks it names

    def __init__(self, name: str) -> None:
        import kvdevice

        for part in ("intercept", "runtime", "triton_cpu.py", "origin.py"):
            also_skip(Path(kvdevice.__file__).parent / part)
        super().__init__(make_runtime("sim"), name)
        self.host.rename_owner("the program")
        self.graphs = SimGraphs(self)
        self.watch = SimWatch(self)
        self.host.on_reuse = self._pinned_reused
        self.lock = self.watch.lock
        self.mode = ProgramMode(self)
        self._polls: set[tuple] = set()  # what a query of the program found not done (query_event)
        self._records: weakref.WeakKeyDictionary[Any, OpStamp] = weakref.WeakKeyDictionary()  # event -> its record
        # a device block's key -> its latest allocations' lines, by generation (a race is collected after
        # the block may have been handed out again: it names the allocation its access used)
        self._device_sites: dict[tuple, dict[int, Site]] = {}
        self.unfollowed: list[str] = []  # one line each: what the program did that could not be followed
        self.sim_ops.dispatch = self._locked(self.sim_ops.dispatch)  # type: ignore[method-assign]
        self._lock_stand_ins()

    # -- labels --------------------------------------------------------------------------------------
    def stream_name(self, number: int) -> str:
        return f"stream {number} (created at {caller_site().short})"

    def _stream(self, stream: Any = None) -> str:
        """How a report names ``stream`` (None: the current one)."""
        name = (stream or self.rt.current_stream()).name
        return "the default stream" if name == "main" else name

    def site_text(self) -> str:
        return caller_site().short

    def enqueue(self, fn: Callable[[], None], *, name: str, reads: Sequence[Any] = (), writes: Sequence[Any] = (),
                cache_written: bool = False, uses: Sequence[Any] = ()) -> OpStamp:
        with self._labelled(name, (*reads, *writes, *uses)):
            return super().enqueue(fn, name=name, reads=reads, writes=writes, cache_written=cache_written)

    def run_now(self, fn: Callable[[], None], *, name: str, reads: Sequence[Any] = (), writes: Sequence[Any] = (),
                cache_written: bool = False) -> None:
        """A synchronising op (``.item()``, ``.tolist()``, a blocking copy, ``nonzero``), labelled as a
        queued one: without its access a race it is the second side of (a ``.item()`` of a sum another
        stream made, unordered) was found and then dropped."""
        with self._labelled(name, (*reads, *writes)):
            super().run_now(fn, name=name, reads=reads, writes=writes, cache_written=cache_written)

    @contextlib.contextmanager
    def _labelled(self, name: str, touched: Sequence[Any]) -> Iterator[None]:
        """The labels the runtime makes inside carry the op's access (what a report says of it) and
        the generations of the blocks it touches (a reuse is told from a race by them): each lives as
        long as something checks against the op, and no table of every op ever run grows."""
        access = Access(name, self._stream(), caller_site())
        made: list[Label] = []

        def label(text: str) -> Label:
            made.append(Label.of(text, access))
            return made[-1]

        with self.lock:  # one op at a time has its label made (the program's threads share the runtime)
            self.rt.labels = label
            try:
                yield
            finally:
                self.rt.labels = str
        blocks = [getattr(item, "memory", item) for item in touched]
        for made_label in made:
            made_label.generations.update((block.id, block.generation) for block in blocks if hasattr(block, "generation"))

    def boundary(self, what: str) -> None:
        self.watch.boundary(caller_site())

    def cannot_follow(self, error: BaseException) -> bool:
        """A call the simulator cannot follow (a raw copy to an address it does not know): one line,
        and the program gets CUDA's error for the call and goes on (the run is partial)."""
        self.unfollowed.append(f"kvz-sanitize could not follow a call at {caller_site().short}: {error}")
        return True

    def unmodelled_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A custom op with no effect model: one line (the run is partial); it runs at once on the
        simulator's memory, as a synchronising op, none of its accesses checked."""
        from torch.utils._pytree import tree_map

        from racecheck.custom_ops import missing_model, op_name

        name = op_name(func)
        self.unfollowed.append(f"kvz-sanitize cannot follow custom op {name} ({missing_model(name)}) "
                               f"at {caller_site().short}")
        inner = tree_map(lambda v: v._inner if isinstance(v, SimCudaTensor) else v, (args, kwargs))
        box: list[Any] = []
        self.run_now(lambda: box.append(func(*inner[0], **inner[1])), name=name)
        return box[0]

    def _pinned_reused(self, tensor: torch.Tensor, origin: str) -> None:
        """The caching host allocator handed ``tensor``'s bytes out again: a host write of them, checked
        against the device work still pending on the block's last tenant (LMCache #4830)."""
        what = f"{HANDED_OUT_AGAIN} ({origin})"
        self.watch.host_access(tensor, write=True, what=what, site=caller_site(), reused=True)

    # -- what the program runs under ------------------------------------------------------------------
    def patch_tables(self) -> list[tuple[Any, dict[str, Any]]]:
        from sanitizer.sim.device_api import device_api, nvtx_api

        tables = [(torch.cuda.nvtx, nvtx_api())]
        for module, table in super().patch_tables():
            table = {name: self._locked(value) if callable(value) and not isinstance(value, type) else value
                     for name, value in table.items()}
            if module is torch.cuda:
                table.update(graph_classes(self))
                table.update(device_api(self))
            tables.append((module, table))
        return tables

    def modes(self) -> list[Any]:
        return [*super().modes(), HostOps(self)]

    def allocation_context(self) -> str:
        return ""  # the race's "allocated at" line says where (device_allocated)

    def device_allocated(self, block: Any) -> None:
        """An op of the program was handed ``block``: its line is where a race on it says it was allocated."""
        sites = self._device_sites.setdefault(block.key, {})
        sites[block.generation] = caller_site()
        if len(sites) > KEPT_GENERATIONS:
            del sites[min(sites)]

    def device_site(self, key: Any, generation: int | None = None) -> Site | None:
        """The line the device block keyed ``key`` was allocated at, in its allocation ``generation``
        (None: the latest; None is returned for no device block of the program, or a generation long gone)."""
        sites = self._device_sites.get(key)
        if not sites:
            return None
        return sites.get(max(sites) if generation is None else generation)

    def event_recorded(self, event: Any) -> None:
        """The program recorded ``event``: its record, as a stamp whose label names the line, for a
        read of its time (:meth:`event_times_read`)."""
        thread = event.stream.thread
        label = Label.of("event record", Access("event record", self._stream(event.stream), caller_site()))
        self._records[event] = OpStamp(thread, event.hb_snapshot[thread], event.hb_snapshot, label)

    def event_times_read(self, start: Any, end: Any) -> None:
        """``start.elapsed_time(end)``: the host reads the events' times (:meth:`HostWatch.event_times_read`)."""
        with self.lock:
            self.watch.event_times_read([self._records.get(start), self._records.get(end)], caller_site())

    def query_event(self, event: Any) -> bool:
        """The program's ``Event.query()``: a polled event completes, as a GPU's does while the host
        polls.

        On the simulator queued work runs only when the host synchronises, so a loop that polls
        ``end_event.query()`` with a sleep until it is True (vLLM's offloading handler's
        ``get_finished``, SGLang's cache controller's acks) would never end. A query that finds the
        work not done still answers False, and gives the host no order; it is the synchronisation
        point at which force mode opens its gates on a GPU: the work up to that event runs at the
        next query of it, which answers True. What the host writes between the two queries is what
        a held copy reads, as under force mode. Only the program's queries poll: the allocators'
        own looks at an event are the runtime's (a block is reused only once its work has run)."""
        if self.rt.query_event(event):
            return True
        return self._polled(("event", event.index, event.stream.index, event.position),
                            lambda: self.rt.synchronize_event(event))

    def query_stream(self, stream: Any) -> bool:
        """The program's ``Stream.query()``: as :meth:`query_event`, for the stream's work so far."""
        if self.rt.query_stream(stream):
            return True
        return self._polled(("stream", stream.index, self.rt.queues.enqueued[stream.index]),
                            lambda: self.rt.synchronize_stream(stream))

    def _polled(self, key: tuple, catch_up: Callable[[], None]) -> bool:
        """False the first time ``key`` is found not done; the next time, the device got there."""
        if key not in self._polls:
            self._polls.add(key)
            return False
        self._polls.discard(key)
        catch_up()
        return True

    def _locked(self, call: Callable[..., Any]) -> Callable[..., Any]:
        lock = self.lock

        @forwarding
        @functools.wraps(call)
        def locked(*args: Any, **kwargs: Any) -> Any:
            with lock:
                return call(*args, **kwargs)

        return locked

    def _lock_stand_ins(self) -> None:
        """Each stream and event call is one step, whichever thread makes it."""
        api = self.cuda_api
        for cls in (api.Stream, api.Event, api.GenericEvent):
            for name in ("wait_event", "wait_stream", "record_event", "query", "synchronize", "record", "wait",
                         "__enter__", "__exit__"):
                method = getattr(cls, name, None)
                if method is not None and name not in cls.__dict__:
                    setattr(cls, name, self._locked(method))
        original = self.triton.patches

        def patches() -> dict[str, Any]:
            return {name: self._locked(value) for name, value in original().items()}

        self.triton.patches = patches  # type: ignore[method-assign]


class ProgramMode(InterceptMode):
    """The intercept mode of a program session: every torch call one step under the session's lock,
    and pinned memory's numpy views and ``.tolist()`` seen as host accesses."""

    def __init__(self, session: ProgramSession) -> None:
        super().__init__(session)
        self._handlers[torch.Tensor.numpy] = self._watched_numpy
        self._handlers[torch.Tensor.__array__] = self._watched_numpy
        self._handlers[torch.Tensor.tolist] = self._pinned_tolist

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        with self.session.lock:
            return super().__torch_function__(func, types, args, kwargs)

    def _watched_numpy(self, func: Any, args: tuple, kwargs: dict) -> Any:
        array = self._numpy(func, args, kwargs)
        tensor = args[0]
        if isinstance(tensor, torch.Tensor) and not isinstance(tensor, SimCudaTensor) and func is torch.Tensor.numpy:
            return self.session.watch.numpy_taken(tensor, array, caller_site())
        return array

    def _pinned_tolist(self, func: Any, args: tuple, kwargs: dict) -> Any:
        tensor = args[0]
        if isinstance(tensor, torch.Tensor) and not isinstance(tensor, SimCudaTensor):
            self.session.watch.tolist_read(tensor, caller_site())
        return self._tolist(func, args, kwargs)


class HostOps(SanitizerMode):
    """Aten ops on the CPU side of a program session: host reads and writes of pinned memory
    (:mod:`sanitizer.host_ops`). The simulated device's own work, run on the CPU when a stream gets
    there, is not the host's and passes through."""

    def __init__(self, session: ProgramSession) -> None:
        super().__init__()
        self.session = session

    @forwarding
    def on_dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        session = self.session
        if session.rt.executing or not session.host.regions:
            return func(*args, **kwargs)
        tensors = tensors_of(args, kwargs)
        if not tensors or any(isinstance(t, SimCudaTensor) for t in tensors):
            return func(*args, **kwargs)
        return session.watch.host_op(func, args, kwargs, tensors)


class SimWatch(HostWatch):
    """The host side of a program on the simulator (:class:`~sanitizer.watch.HostWatch`)."""

    device_key = "simdev"  # kvdevice.intercept.sim_memory: a block's key, its generation on the labels

    def __init__(self, session: ProgramSession) -> None:
        super().__init__(session.rt.hb, session.rt.threads, session.host)
        self.session = session

    def allocated_at(self, hazard: Any) -> Site | None:
        """The line of the allocation the race's later access used (a reuse: the new one), not the
        block's latest, which may have come after the race."""
        key = hazard.key
        generation = None
        if isinstance(key, tuple) and key[:1] == (self.device_key,):
            generation = getattr(hazard.second, "generations", {}).get(key[1])
        site = self.session.device_site(key, generation)
        return site if site is not None else super().allocated_at(hazard)

    def scope_end(self, site: Site) -> None:
        """:meth:`HostWatch.scope_end`, after the work still queued has run.

        On a GPU what a program leaves queued runs after its last line; on the simulator a stream
        runs only when something waits for it, and an indexed op (``kv[ids] = x``, ``index_copy_``)
        says which rows it touches only when it runs (:mod:`kvdevice.intercept.sim_ops`). Unrun, a
        write the program never waited for was never checked against the other streams. It runs
        here as a free stream would, each stream as far as its waits allow; the host is not said
        to have seen any of it complete (no synchronisation), so no host access is ordered by it."""
        with self.lock:
            try:
                _run_what_is_queued(self.session.rt)
            except Exception as error:  # noqa: BLE001 - the program's queued op failed: said, not raised
                if blame(error).harness:
                    raise
                # on a GPU an asynchronous CUDA error after the program's last line; the work queued
                # behind it cannot run in order, so what it would touch is not checked
                self.notes.append(f"kvz-sanitize: work the program left queued failed when it ran after the "
                                  f"program's end ({type(error).__name__}: {str(error).splitlines()[0]}); "
                                  f"the work queued behind it was not checked")
        super().scope_end(site)

    def _setup_thread(self) -> Callable[[], None] | None:
        """Enter the session's modes in a thread the program started; the function that leaves them."""
        modes = [ProgramMode(self.session), HostOps(self.session)]
        for mode in modes:
            mode.__enter__()

        def leave() -> None:
            for mode in reversed(modes):
                mode.__exit__(None, None, None)

        return leave


def _run_what_is_queued(rt: Any) -> None:
    """Let every stream of ``rt`` run as far as its waits allow (stream order kept, the host not told)."""
    ran = True
    while ran:
        ran = False
        for stream in list(rt.streams):
            if rt.pending(stream) and rt.advance(stream, rt.pending(stream)):
                ran = True


@contextlib.contextmanager
def sanitized(session: ProgramSession, what: str) -> Iterator[None]:
    """Run ``what`` of the program under ``session``, its host hooks active."""
    session.watch.activate_host_hooks()
    try:
        with session.rt.annotate(owner=PROGRAM), session.running(what):
            session.watch.mark_set_up()
            yield
    finally:
        try:
            session.watch.scope_end(caller_site())
        finally:  # the hooks go whatever the final check raises: no later test is watched by this one
            session.watch.deactivate_host_hooks()


def simulate(main: Callable[[], Any], name: str = "program") -> tuple[list[Race], BaseException | None, list[str], list[str]]:
    """Run ``main`` with its ``cuda`` work on the simulator; its races, what it raised (if anything,
    ``KeyboardInterrupt`` and ``SystemExit`` included: the races seen before are not lost), the
    notes (what was assumed) and the lines of what could not be followed."""
    session = ProgramSession(name)
    raised: BaseException | None = None
    with sanitized(session, "main"):
        try:
            main()
        except (Exception, KeyboardInterrupt, SystemExit) as error:  # noqa: BLE001 - reported beside its races
            raised = error
    return session.watch.races, raised, session.watch.notes, session.unfollowed


__all__ = ["ProgramSession", "Site", "sanitized", "simulate"]
