"""``torch.cuda``'s streams, events and synchronisation, as seen by an intercepted zeroer.

While a plain torch zeroer runs, ``torch.cuda.Stream``, ``torch.cuda.Event``, ``current_stream``,
``default_stream``, ``stream(...)``, ``set_stream``, ``synchronize``, the device-generic
``torch.Stream`` and ``torch.Event``, and ``torch.accelerator``'s ``current_stream``,
``set_stream`` and ``synchronize`` are replaced by stand-ins over the harness's runtime
(:meth:`CudaApi.patch_tables`; on the simulator also the device queries of
:mod:`kvdevice.intercept.sim_device`). A stream is a runtime stream (``torch.cuda.Stream()`` makes a
new one; ``current_stream()`` is the stream the harness made current for the call), an event a
runtime event, so recording, waiting, querying and synchronising are ordered, scheduled and
checked by the runtime exactly as a runtime-API zeroer's calls are. ``torch.accelerator.synchronize()``
(vLLM #48085's ring calls it when it grows) is the runtime's synchronisation on both backends: in
the controlled CUDA mode a real device synchronisation would wait for ops parked behind the
runtime's gates, which only the runtime releases. The stand-ins are found through the modules:
a zeroer that bound ``from torch.cuda import Stream`` before the harness loaded it keeps torch's
own (docs/fuzz-your-zeroer.md).

Which stream is current follows CUDA: ``with torch.cuda.stream(s):`` and ``with s:`` restore the
stream that was current when they were entered; ``torch.cuda.set_stream(s)`` switches until the
next switch (vLLM's ``stream(to, from)`` helper sets ``to`` and, in its ``finally``, ``from``
again). Whatever the zeroer switched to, the caller's stream is current again when its call ends
(:meth:`CudaApi.restore_streams`): a zeroer may not leave the caller on another stream.

The real classes stay reachable for the runtime itself, which captured them at import.

Example (inside an intercepted call)::

    side = torch.cuda.Stream()
    done = torch.cuda.Event()
    done.record()                      # on the current stream
    side.wait_event(done)
    with torch.cuda.stream(side):
        ...                            # queued on the runtime stream 'zeroer-1'
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Any
from unittest import mock

import torch

from racecheck import real_cuda
from kvdevice.intercept.errors import unroutable
from kvdevice.origin import forwarding, stand_in
from kvdevice.runtime import Event, Runtime, Stream

#: (lowest, highest) stream priority on the simulator, as ``torch.cuda.Stream.priority_range()``
#: reports it on a current NVIDIA GPU (CUDA's range, capped by torch's pools of priority streams)
SIM_PRIORITY_RANGE = (0, -3)


@stand_in
class StreamProxy:
    """``torch.cuda.Stream`` over a runtime stream (each session makes a subclass bound to it)."""

    _api: "CudaApi"
    runtime_stream: Stream

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> "StreamProxy":
        # What the zeroer's ``torch.cuda.Stream(...)`` does: a new runtime stream.
        return cls._api.new_stream(device, priority, **kwargs)

    @classmethod
    def _over(cls, stream: Stream) -> "StreamProxy":
        proxy = object.__new__(cls)
        proxy.runtime_stream = stream
        return proxy

    @property
    def device(self) -> torch.device:
        return self._api.device

    @property
    def cuda_stream(self) -> int:
        handle = self.runtime_stream.handle
        return int(getattr(handle, "cuda_stream", 0x5E000 + self.runtime_stream.index))

    @property
    def priority(self) -> int:
        return self._api.priorities.get(id(self.runtime_stream), 0)

    @classmethod
    def priority_range(cls) -> tuple[int, int]:
        """(lowest, highest) priority, as torch gives them (vLLM's SimpleCPUOffload makes its copy
        streams at the lowest): a priority changes what the GPU prefers, never what is ordered,
        so the harness keeps every interleaving."""
        return cls._api.priority_range()

    # torch.Stream's identity (torch.Stream() is this class too)
    @property
    def stream_id(self) -> int:
        return self.cuda_stream

    @property
    def device_index(self) -> int:
        return self._api.device.index or 0

    @property
    def device_type(self) -> int:
        return 1  # c10::DeviceType::CUDA

    def wait_event(self, event: "EventProxy") -> None:
        if self._api.ordering("Stream.wait_event"):
            self._api.rt.wait_event(self._api.event_of(event), stream=self.runtime_stream)

    def wait_stream(self, stream: "StreamProxy") -> None:
        if not self._api.ordering("Stream.wait_stream"):
            return
        other = self._api.stream_of(stream)
        marker = self._api.rt.record_event(stream=other)
        self._api.rt.wait_event(marker, stream=self.runtime_stream)

    def record_event(self, event: "EventProxy | None" = None) -> "EventProxy":
        event = event if event is not None else self._api.Event()
        event.record(self)
        return event

    def query(self) -> bool:
        self._api.syncing("Stream.query")
        return self._api.session.query_stream(self.runtime_stream)

    def synchronize(self) -> None:
        self._api.syncing("Stream.synchronize")
        self._api.rt.synchronize_stream(self.runtime_stream)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StreamProxy) and other.runtime_stream is self.runtime_stream

    def __hash__(self) -> int:
        return hash(id(self.runtime_stream))

    def __repr__(self) -> str:
        return f"<torch.cuda.Stream (intercepted) runtime stream '{self.runtime_stream.name}'>"

    def __enter__(self) -> "StreamProxy":  # ``with s:``, as ``with torch.cuda.stream(s):``
        self._api._threads.with_scopes.append(self._api.open_scope(self.runtime_stream, "with"))
        return self

    def __exit__(self, *exc: object) -> None:
        self._api.close_scope(self._api._threads.with_scopes.pop())


@stand_in
class EventProxy:
    """``torch.cuda.Event`` over a runtime event (each session makes a subclass bound to it)."""

    _api: "CudaApi"
    _spelled = "torch.cuda.Event"

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        # ``blocking`` only changes how the host waits in synchronize(), not what it waits for.
        # Timing events are what engines time every transfer with (vLLM's offloading handler,
        # SGLang's HiCache): real on CUDA, the simulator's clock on the simulator.
        if interprocess:
            raise unroutable(
                f"{self._spelled}(enable_timing={enable_timing}, interprocess={interprocess})",
                "an interprocess event is waited on by another process, which the harness cannot follow",
                "create the event with interprocess=False",
            )
        self.runtime_event: Event = self._api.rt.new_event(timing=bool(enable_timing))

    def record(self, stream: StreamProxy | None = None) -> None:
        if self._api.ordering("Event.record"):
            self._api.rt.record_event(self.runtime_event, stream=self._api.stream_of(stream))
            self._api.session.event_recorded(self.runtime_event)

    def wait(self, stream: StreamProxy | None = None) -> None:
        if self._api.ordering("Event.wait"):
            self._api.rt.wait_event(self.runtime_event, stream=self._api.stream_of(stream))

    def query(self) -> bool:
        self._api.syncing("Event.query")
        return self._api.session.query_event(self.runtime_event)

    def synchronize(self) -> None:
        self._api.syncing("Event.synchronize")
        self._api.rt.synchronize_event(self.runtime_event)

    @forwarding  # the code's own call: what the runtime refuses here, CUDA refuses at this call (kvdevice.origin)
    def elapsed_time(self, end_event: "EventProxy") -> float:
        """Milliseconds between the two records (``Runtime.elapsed_time``: torch's errors where
        an event was made without timing, never recorded, or has not completed)."""
        self._api.syncing("Event.elapsed_time")
        end = self._api.event_of(end_event)
        self._api.session.event_times_read(self.runtime_event, end)
        return self._api.rt.elapsed_time(self.runtime_event, end)

    def ipc_handle(self) -> Any:
        raise unroutable("torch.cuda.Event.ipc_handle", "events cannot leave the harness's process")

    @property
    def cuda_event(self) -> int:
        handle = self.runtime_event.handle
        return int(getattr(handle, "cuda_event", 0xE0000 + self.runtime_event.index))

    @property
    def device(self) -> torch.device:
        return self._api.device

    def __repr__(self) -> str:
        return f"<{self._spelled} (intercepted) {self.runtime_event!r}>"


class _GenericEvent(EventProxy):
    """``torch.Event(device=None, *, ...)``: the device-generic event, on the current accelerator."""

    _spelled = "torch.Event"

    def __init__(self, device: Any = None, *, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False) -> None:
        super().__init__(enable_timing, blocking, interprocess)


@stand_in
class _StreamContext:
    """``torch.cuda.stream(s)``: make ``s`` current inside (None: no change)."""

    def __init__(self, api: "CudaApi", stream: StreamProxy | None) -> None:
        self._api = api
        self._stream = api.stream_of(stream) if stream is not None else None
        self._opened: list[_Opened] = []

    def __enter__(self) -> None:
        if self._stream is not None:
            self._opened.append(self._api.open_scope(self._stream, "with"))

    def __exit__(self, *exc: object) -> None:
        if self._opened:
            self._api.close_scope(self._opened.pop())


class _Opened:
    """A stream made current by the zeroer: by a ``with`` scope or ``set_stream``, and what was current before."""

    __slots__ = ("kind", "scope", "previous")

    def __init__(self, kind: str, scope: Any, previous: Stream) -> None:
        self.kind, self.scope, self.previous = kind, scope, previous


class _ThreadScopes(threading.local):
    """Per thread, as CUDA's current stream is: the streams the thread made current, innermost
    last (``opened``), and its ``with s:`` scopes on stream objects (``with_scopes``)."""

    def __init__(self) -> None:
        self.opened: list[_Opened] = []
        self.with_scopes: list[_Opened] = []


class CudaApi:
    """The stand-ins of one session, and the patches that install them (see the module docstring)."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.rt: Runtime = session.rt
        self.device = session.device
        self._proxies: dict[int, StreamProxy] = {}
        self.priorities: dict[int, int] = {}  # id(runtime stream) -> the priority it was made with
        self._made = itertools.count(1)
        self._threads = _ThreadScopes()
        # What the zeroer sees as torch.cuda.Stream and torch.cuda.Event: classes bound to this session.
        # torch.Stream() is the same class: on the current accelerator, CUDA, it makes a CUDA stream.
        self.Stream: type[StreamProxy] = type("Stream", (StreamProxy,), {"_api": self, "__module__": "torch.cuda"})
        self.Event: type[EventProxy] = type("Event", (EventProxy,), {"_api": self, "__module__": "torch.cuda"})
        self.GenericEvent: type[EventProxy] = type("Event", (_GenericEvent, self.Event), {"_api": self, "__module__": "torch"})

    def boundary(self, what: str) -> None:
        self.session.boundary(what)

    def ordering(self, what: str) -> bool:
        """The code's stream-ordering call ``what`` (a boundary): whether it orders runtime streams,
        False while a graph is captured (it is a node of that graph, ordering nothing outside it)."""
        self.boundary(what)
        graphs = self.session.graphs
        return graphs is None or graphs.current() is None

    def syncing(self, what: str) -> None:
        """The code's host-synchronising call ``what`` (a boundary), refused while a graph is captured."""
        self.boundary(what)
        self.refuse_sync(what)

    def refuse_sync(self, what: str) -> None:
        if self.session.graphs is not None:
            self.session.graphs.refuse_sync(what)

    # -- proxies ---------------------------------------------------------------------------------
    def proxy(self, stream: Stream) -> StreamProxy:
        proxy = self._proxies.get(id(stream))
        if proxy is None:
            proxy = self._proxies[id(stream)] = self.Stream._over(stream)
        return proxy

    def stream_of(self, stream: Any) -> Stream:
        """The runtime stream a zeroer's stream argument means (None: the current one)."""
        if stream is None:
            return self.rt.current_stream()
        if isinstance(stream, StreamProxy):
            return stream.runtime_stream
        raise unroutable(
            f"a stream argument of type {type(stream).__name__} ({stream!r})",
            "it is not a stream the harness made (torch.cuda.Stream() or torch.cuda.current_stream() "
            "while the code under test runs)",
        )

    def event_of(self, event: Any) -> Event:
        if isinstance(event, EventProxy):
            return event.runtime_event
        raise unroutable(f"an event argument of type {type(event).__name__} ({event!r})",
                         "it is not an event the harness made (torch.cuda.Event() while the code under test runs)")

    def new_stream(self, device: Any = None, priority: int = 0, **kwargs: Any) -> StreamProxy:
        if kwargs:
            raise unroutable(f"torch.cuda.Stream(**{kwargs!r})", "only device and priority are supported")
        self.boundary("torch.cuda.Stream()")
        proxy = self.proxy(self.rt.new_stream(self._stream_name()))
        # CUDA clamps a priority to the device's range (cudaStreamCreateWithPriority)
        lowest, highest = self.priority_range()
        self.priorities[id(proxy.runtime_stream)] = min(lowest, max(highest, int(priority)))
        return proxy

    def priority_range(self) -> tuple[int, int]:
        if self.session.backend == "sim":
            return SIM_PRIORITY_RANGE
        return tuple(real_cuda.Stream.priority_range())  # type: ignore[return-value]

    def from_handle(self, handle: Any) -> StreamProxy:
        """``torch.cuda.ExternalStream(handle)`` and ``get_stream_from_external(handle)``: a raw
        handle (``stream.cuda_stream``) the harness gave out names that stream again; any other
        is a stream made outside torch, which the harness cannot order."""
        for stream in self.rt.streams:
            if self.proxy(stream).cuda_stream == int(handle):
                return self.proxy(stream)
        raise unroutable(f"torch.cuda.ExternalStream({handle!r})",
                         "it is a stream the harness did not make, so it can neither order nor schedule it",
                         "use a stream made with torch.cuda.Stream() (its .cuda_stream is followed)")

    def _stream_name(self) -> str:
        """The session's name for its next stream (``zeroer-1``, ``zeroer[1]-1`` for the runtime's
        second zeroer: kvdevice.intercept.shared): unique per runtime, the same on every run."""
        taken = {s.name for s in self.rt.streams}
        while True:
            name = self.session.stream_name(next(self._made))
            if name not in taken:  # a name the runtime's owner gave one of its own streams
                return name

    # -- functions -------------------------------------------------------------------------------
    def current_stream(self, device: Any = None) -> StreamProxy:
        return self.proxy(self.rt.current_stream())

    def default_stream(self, device: Any = None) -> StreamProxy:
        return self.proxy(self.rt.default_stream)

    def stream(self, stream: StreamProxy | None) -> _StreamContext:
        self.boundary("torch.cuda.stream()")
        return _StreamContext(self, stream)

    def set_stream(self, stream: StreamProxy) -> None:
        """``torch.cuda.set_stream(s)``: ``s`` is current until the next switch, or the call's end."""
        target = self.stream_of(stream)
        self.boundary("torch.cuda.set_stream")
        top = self._threads.opened[-1] if self._threads.opened else None
        if top is not None and top.kind == "set" and top.previous is target:
            self.close_scope(top)  # switching back (vLLM's helper, in its finally): the switch is undone
        elif target is not self.rt.current_stream():
            self.open_scope(target, "set")

    def open_scope(self, stream: Stream, kind: str) -> _Opened:
        """Make ``stream`` current (``kind``: ``with`` or ``set``), remembering what was."""
        previous = self.rt.current_stream()
        scope = self.rt.use_stream(stream)
        scope.__enter__()
        opened = _Opened(kind, scope, previous)
        self._threads.opened.append(opened)
        return opened

    def close_scope(self, opened: _Opened) -> None:
        """Leave ``opened``: as CUDA's stream scope restores the stream current at its entry, the
        switches made inside it are undone first (the runtime's scopes nest)."""
        while opened in self._threads.opened:
            self._threads.opened.pop().scope.__exit__(None, None, None)

    def restore_streams(self) -> None:
        """At the end of a zeroer's call: every stream it made current is undone, innermost first."""
        self._threads.with_scopes.clear()
        while self._threads.opened:
            self._threads.opened.pop().scope.__exit__(None, None, None)

    def synchronize(self, device: Any = None) -> None:
        """``torch.cuda.synchronize()`` and ``torch.accelerator.synchronize()``: every stream's work."""
        self.boundary("synchronize")
        self.refuse_sync("torch.cuda.synchronize")
        self.rt.synchronize()

    # -- patches ---------------------------------------------------------------------------------
    def patch_tables(self) -> list[tuple[Any, dict[str, Any]]]:
        """(module, attribute -> stand-in) for the session's patch scope."""
        def refuse(name: str, fix: str = "") -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                raise unroutable(f"torch.cuda.{name}", "the harness cannot order or schedule it", *((fix,) if fix else ()))
            return call

        cuda: dict[str, Any] = {
            "Stream": self.Stream,
            "Event": self.Event,
            "current_stream": self.current_stream,
            "default_stream": self.default_stream,
            "stream": self.stream,
            "set_stream": self.set_stream,
            "synchronize": self.synchronize,
            "ExternalStream": lambda stream_ptr, device=None: self.from_handle(stream_ptr),
            "get_stream_from_external": lambda data_ptr, device=None: self.from_handle(data_ptr),
            "CUDAGraph": refuse("CUDAGraph"),
            "graph": refuse("graph"),
            "caching_allocator_alloc": refuse("caching_allocator_alloc"),
        }
        generic = {"Stream": self.Stream, "Event": self.GenericEvent}
        accelerator: dict[str, Any] = {
            "current_stream": self.current_stream,
            "set_stream": self.set_stream,
            "synchronize": self.synchronize,
        }
        tables = [(torch.cuda, cuda), (torch, generic), (torch.accelerator, accelerator)]
        if self.session.backend == "sim":
            from torch.utils._device import DeviceContext

            from kvdevice.intercept.sim_device import ACCELERATOR, CUDA_DEVICE, TORCH
            from kvdevice.intercept.torch_mode import default_device_patches

            cuda.update(CUDA_DEVICE)
            accelerator.update(ACCELERATOR)
            generic.update(TORCH)
            tables.append((DeviceContext, default_device_patches()))  # torch.set_default_device("cuda")
        return tables


def patched(module: Any, table: dict[str, Any]) -> contextlib.AbstractContextManager:
    """Set ``module.<name>`` to each stand-in inside, and put every original back on exit, even on error."""
    return mock.patch.multiple(module, create=True, **table)
