"""``torch.cuda``'s streams, events and synchronisation, as seen by an intercepted zeroer.

While a plain torch zeroer runs, ``torch.cuda.Stream``, ``torch.cuda.Event``, ``current_stream``,
``default_stream``, ``stream(...)``, ``set_stream``, ``synchronize`` (and, on the simulator,
``is_available``, ``device_count``, ``current_device``, ``set_device``, ``device``,
``get_device_name``, ``get_device_capability``) are replaced by stand-ins over the harness's
runtime (:meth:`CudaApi.patches`). A stream is a runtime stream (``torch.cuda.Stream()`` makes a
new one; ``current_stream()`` is the stream the harness made current for the call), an event a
runtime event, so recording, waiting, querying and synchronising are ordered, scheduled and
checked by the runtime exactly as a runtime-API zeroer's calls are. The stand-ins are found
through the ``torch.cuda`` module: a zeroer that bound ``from torch.cuda import Stream`` before
the harness loaded it keeps torch's own (docs/fuzz-your-zeroer.md).

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
from typing import Any, Iterator

import torch

from zeroer.intercept.errors import unroutable
from zeroer.origin import stand_in
from zeroer.runtime import Event, Runtime, Stream


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
        return 0

    def wait_event(self, event: "EventProxy") -> None:
        self._api.boundary("Stream.wait_event")
        self._api.rt.wait_event(self._api.event_of(event), stream=self.runtime_stream)

    def wait_stream(self, stream: "StreamProxy") -> None:
        self._api.boundary("Stream.wait_stream")
        other = self._api.stream_of(stream)
        marker = self._api.rt.record_event(stream=other)
        self._api.rt.wait_event(marker, stream=self.runtime_stream)

    def record_event(self, event: "EventProxy | None" = None) -> "EventProxy":
        event = event if event is not None else self._api.Event()
        event.record(self)
        return event

    def query(self) -> bool:
        self._api.boundary("Stream.query")
        return self._api.rt.query_stream(self.runtime_stream)

    def synchronize(self) -> None:
        self._api.boundary("Stream.synchronize")
        self._api.rt.synchronize_stream(self.runtime_stream)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StreamProxy) and other.runtime_stream is self.runtime_stream

    def __hash__(self) -> int:
        return hash(id(self.runtime_stream))

    def __repr__(self) -> str:
        return f"<torch.cuda.Stream (intercepted) runtime stream '{self.runtime_stream.name}'>"

    def __enter__(self) -> "StreamProxy":
        self._api._contexts.append(self._api.rt.use_stream(self.runtime_stream))
        self._api._contexts[-1].__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._api._contexts.pop().__exit__(*exc)


@stand_in
class EventProxy:
    """``torch.cuda.Event`` over a runtime event (each session makes a subclass bound to it)."""

    _api: "CudaApi"

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        if enable_timing or interprocess:
            raise unroutable(
                f"torch.cuda.Event(enable_timing={enable_timing}, interprocess={interprocess})",
                "timing and interprocess events have no meaning on the harness's schedule",
                "create the event without them (the zeroer contract needs ordering only)",
            )
        self.runtime_event: Event = self._api.rt.new_event()

    def record(self, stream: StreamProxy | None = None) -> None:
        self._api.boundary("Event.record")
        self._api.rt.record_event(self.runtime_event, stream=self._api.stream_of(stream))

    def wait(self, stream: StreamProxy | None = None) -> None:
        self._api.boundary("Event.wait")
        self._api.rt.wait_event(self.runtime_event, stream=self._api.stream_of(stream))

    def query(self) -> bool:
        self._api.boundary("Event.query")
        return self._api.rt.query_event(self.runtime_event)

    def synchronize(self) -> None:
        self._api.boundary("Event.synchronize")
        self._api.rt.synchronize_event(self.runtime_event)

    def elapsed_time(self, end_event: "EventProxy") -> float:
        raise unroutable("torch.cuda.Event.elapsed_time", "the harness's schedule has no wall-clock timing",
                         "time the zeroer outside the fuzzer (python -m fuzz.bench.kernel)")

    def ipc_handle(self) -> Any:
        raise unroutable("torch.cuda.Event.ipc_handle", "events cannot leave the harness's process")

    @property
    def cuda_event(self) -> int:
        handle = self.runtime_event.handle
        return int(getattr(handle, "cuda_event", 0xE0000 + self.runtime_event.index))

    def __repr__(self) -> str:
        return f"<torch.cuda.Event (intercepted) {self.runtime_event!r}>"


@stand_in
class _StreamContext:
    """``torch.cuda.stream(s)``: make ``s`` current inside (None: no change)."""

    def __init__(self, api: "CudaApi", stream: StreamProxy | None) -> None:
        self._scope = api.rt.use_stream(api.stream_of(stream)) if stream is not None else contextlib.nullcontext()

    def __enter__(self) -> None:
        self._scope.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._scope.__exit__(*exc)


@stand_in
class _DeviceContext:
    """``torch.cuda.device(i)`` on the simulator: there is one device, 0."""

    def __init__(self, device: Any = None) -> None:
        pass

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class CudaApi:
    """The stand-ins of one session, and the patches that install them (see the module docstring)."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.rt: Runtime = session.rt
        self.device = session.device
        self._proxies: dict[int, StreamProxy] = {}
        self._made = itertools.count(1)
        self._contexts: list[Any] = []
        # What the zeroer sees as torch.cuda.Stream and torch.cuda.Event: classes bound to this session.
        self.Stream: type[StreamProxy] = type("Stream", (StreamProxy,), {"_api": self, "__module__": "torch.cuda"})
        self.Event: type[EventProxy] = type("Event", (EventProxy,), {"_api": self, "__module__": "torch.cuda"})

    def boundary(self, what: str) -> None:
        self.session.boundary(what)

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
            "while the zeroer runs)",
        )

    def event_of(self, event: Any) -> Event:
        if isinstance(event, EventProxy):
            return event.runtime_event
        raise unroutable(f"an event argument of type {type(event).__name__} ({event!r})",
                         "it is not an event the harness made (torch.cuda.Event() while the zeroer runs)")

    def new_stream(self, device: Any = None, priority: int = 0, **kwargs: Any) -> StreamProxy:
        if kwargs:
            raise unroutable(f"torch.cuda.Stream(**{kwargs!r})", "only device and priority are supported")
        self.boundary("torch.cuda.Stream()")
        return self.proxy(self.rt.new_stream(f"zeroer-{next(self._made)}"))

    # -- functions -------------------------------------------------------------------------------
    def current_stream(self, device: Any = None) -> StreamProxy:
        return self.proxy(self.rt.current_stream())

    def default_stream(self, device: Any = None) -> StreamProxy:
        return self.proxy(self.rt.default_stream)

    def stream(self, stream: StreamProxy | None) -> _StreamContext:
        self.boundary("torch.cuda.stream()")
        return _StreamContext(self, stream)

    def set_stream(self, stream: StreamProxy) -> None:
        raise unroutable("torch.cuda.set_stream", "a zeroer may not change the caller's current stream for good",
                         "use `with torch.cuda.stream(s):` around the work instead")

    def synchronize(self, device: Any = None) -> None:
        self.boundary("torch.cuda.synchronize")
        self.rt.synchronize()

    # -- patches ---------------------------------------------------------------------------------
    def patches(self) -> dict[str, Any]:
        """``torch.cuda`` attribute -> stand-in, for the session's patch scope."""
        def refuse(name: str, fix: str = "") -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                raise unroutable(f"torch.cuda.{name}", "the harness cannot order or schedule it", *((fix,) if fix else ()))
            return call

        table: dict[str, Any] = {
            "Stream": self.Stream,
            "Event": self.Event,
            "current_stream": self.current_stream,
            "default_stream": self.default_stream,
            "stream": self.stream,
            "set_stream": self.set_stream,
            "synchronize": self.synchronize,
            "ExternalStream": refuse("ExternalStream"),
            "get_stream_from_external": refuse("get_stream_from_external"),
            "CUDAGraph": refuse("CUDAGraph"),
            "graph": refuse("graph"),
            "caching_allocator_alloc": refuse("caching_allocator_alloc"),
        }
        if self.session.backend == "sim":
            table.update({
                "is_available": lambda: True,
                "is_initialized": lambda: True,
                "init": lambda: None,
                "device_count": lambda: 1,
                "current_device": lambda: 0,
                "set_device": lambda device: None,
                "device": _DeviceContext,
                "get_device_name": lambda device=None: "simulated GPU (kvzero-fuzz)",
                "get_device_capability": lambda device=None: (9, 0),
                "_sleep": refuse("_sleep", "on the simulator a stream is held back by the fuzzer's delay steps"),
            })
        return table


@contextlib.contextmanager
def patched(module: Any, table: dict[str, Any]) -> Iterator[None]:
    """Set ``module.<name>`` to each stand-in inside, and put every original back on exit, even on error."""
    saved: dict[str, Any] = {}
    missing = object()
    try:
        for name, value in table.items():
            saved[name] = getattr(module, name, missing)
            setattr(module, name, value)
        yield
    finally:
        for name, value in saved.items():
            if value is missing:
                delattr(module, name)
            else:
                setattr(module, name, value)
