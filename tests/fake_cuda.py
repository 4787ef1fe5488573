"""A stand-in for CUDA that the GPU observer can watch on a CPU: the observer's race logic in CI
(and :class:`RealCuda`, the same calls on a GPU, so the same tests run there too).

The observer asks its device (sanitizer/gpu/device.py) which tensors are device memory, which host
memory is pinned and which stream the calling thread is on. This stand-in answers for CPU tensors
it was told about: ``cuda.device(t)`` makes ``t`` device memory, ``cuda.pinned(t)`` pinned memory,
and the fresh outputs of ops on device tensors are device memory too. Streams and events are ids
whose calls go to the observer's trace handlers, as torch's GPU trace callbacks would. The ops
themselves run at once on the CPU: the observer's verdicts come from enqueue order and never from
when work runs, which is what makes this stand-in enough for them.

Example::

    cuda = FakeCuda()
    obs = Observer(device=cuda)
    obs.start()
    ids = cuda.device(torch.zeros(4, dtype=torch.int64))
    staging = cuda.pinned(torch.zeros(4, dtype=torch.int64))
    ids.copy_(staging, non_blocking=True)      # a queued H2D copy, to the observer
    staging.numpy()[0] = 7                      # a host write under it
    obs.stop()                                  # -> [Race(host-write-vs-pending-copy, ...)]
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sanitizer.gpu import c_methods, trace
from sanitizer.gpu.device import CudaDevice
from sanitizer.sites import also_skip

also_skip(__file__)  # a stand-in for CUDA: its frames are not the program's


class FakeCuda:
    name = "fake"

    def __init__(self) -> None:
        self._device: set[int] = set()
        self._sizes: dict[int, int] = {}  # storage address -> bytes, of the tensors made device memory
        self._pinned: set[int] = set()
        self._local = threading.local()
        self._ids = itertools.count(0x1000)
        self.obs: Any = None

    # -- memory --------------------------------------------------------------------------------------
    def device(self, tensor: torch.Tensor) -> torch.Tensor:
        self._device.add(tensor.untyped_storage().data_ptr())
        self._sizes[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    def allocation_at(self, address: int, size: int) -> int | None:
        """The device tensor's storage holding ``[address, address + size)`` (a raw access)."""
        return next((b for b, n in self._sizes.items() if b <= address and address + size <= b + n), None)

    def is_pageable(self, address: int, size: int) -> bool:
        """Memory not made device memory here: the CPU's own (pinned memory is the observer's to know)."""
        return self.allocation_at(address, size) is None

    def pinned(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` is pinned memory, allocated here (as ``pin_memory=True`` is, to the observer)."""
        self._pinned.add(tensor.untyped_storage().data_ptr())
        if self.obs is not None:
            from sanitizer.sites import caller_site

            with self.obs.lock:
                self.obs.note_pinned(tensor, caller_site(), "pinned by the test")
        return tensor

    def is_device(self, tensor: torch.Tensor) -> bool:
        # A tensor that calls itself CUDA (the simulator's SimCudaTensor) is device memory, as
        # CudaDevice.is_device (tensor.is_cuda) would take it.
        return tensor.is_cuda or tensor.untyped_storage().data_ptr() in self._device

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self._pinned

    def adopt(self, tensor: torch.Tensor) -> None:
        self._device.add(tensor.untyped_storage().data_ptr())

    def device_index(self, tensor: Any) -> int:
        return 0

    # -- streams and events, as torch's trace callbacks report them -------------------------------------
    def current_stream(self, index: int | None = None) -> int:
        return getattr(self._local, "stream", 0)

    def new_stream(self) -> int:
        stream = next(self._ids)
        self._call(trace.stream_created, stream)
        return stream

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[None]:
        previous = self.current_stream()
        self._local.stream = self.stream_id(stream)
        try:
            yield
        finally:
            self._local.stream = previous

    def record(self, stream: Any = None) -> int:
        event = next(self._ids)
        self._call(trace.event_recorded, event, self.stream_id(stream))
        return event

    def wait(self, event: int, stream: Any = None) -> None:
        self._call(trace.event_waited, event, self.stream_id(stream))

    def synchronize_event(self, event: int) -> None:
        self._call(trace.event_synchronized, event)

    def synchronize_stream(self, stream: int) -> None:
        self._call(trace.stream_synchronized, stream)

    def synchronize(self) -> None:
        self._call(trace.device_synchronized)

    def allocate(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s memory handed out by the caching allocator on the current stream, as its
        trace callback reports it: allocating over a storage handed out before is the allocator
        handing a freed block out again."""
        self.device(tensor)
        self._call(trace.memory_allocated, tensor.untyped_storage().data_ptr())
        return tensor

    # -- the device-generic torch.Event and torch.Stream ------------------------------------------------
    @contextlib.contextmanager
    def generic_types(self) -> Iterator[None]:
        """``torch.Event`` and ``torch.Stream`` inside are subclasses of torch's C types on this
        stand-in: recording, waiting and synchronising report to the observer as torch's trace
        callbacks do for a CUDA event (a CPU build of torch cannot record one), while ``query`` and
        ``elapsed_time`` are the C types' own, as the observer wrapped them (``elapsed_time``
        answering as on a GPU for two recorded events, all of whose work the stand-in ran at once:
        a CPU build raises for any CPU event; an observer started inside wraps this answer)."""
        saved = torch.Event, torch.Stream
        torch.Event, torch.Stream = _event_class(self), _stream_class(self)
        undo = c_methods.replace(torch._C.Event, "elapsed_time", _elapsed_time)
        try:
            yield
        finally:
            undo()
            torch.Event, torch.Stream = saved

    def stream_id(self, stream: Any) -> int:
        """A stream argument (a stand-in id, a :meth:`generic_types` ``torch.Stream``) as a stand-in id."""
        return self.current_stream() if stream is None else int(getattr(stream, "cuda_stream", stream))

    event_handle = CudaDevice.event_handle
    stream_handle = CudaDevice.stream_handle

    def _call(self, handler: Any, *args: Any) -> None:
        obs = self.obs
        if obs is not None and not obs.paused:
            with obs.lock:
                handler(obs, *args)

    # -- CUDA graphs, as the observer's patches of CUDAGraph report them ----------------------------------
    def new_graph(self) -> Any:
        return _FakeGraph()

    @contextlib.contextmanager
    def capture(self, graph: Any) -> Iterator[None]:
        """Ops issued inside are recorded into ``graph`` (and run now, on the CPU)."""
        from sanitizer.sites import caller_site

        with self.obs.lock:
            self.obs.graphs.begin(graph, caller_site())
        try:
            yield
        finally:
            with self.obs.lock:
                self.obs.graphs.end(graph)

    def replay(self, graph: Any) -> None:
        from sanitizer.sites import caller_site

        with self.obs.lock:
            self.obs.graphs.replay(graph, caller_site())

    # -- what the observer asks besides ---------------------------------------------------------------
    def stream_object(self, index: int | None = None) -> Any:
        return self.current_stream()

    def private_stream(self) -> Any:
        return None

    def read_back(self, tensor: torch.Tensor, stream: Any) -> torch.Tensor:
        with torch._C.DisableTorchFunction():
            return tensor.detach().clone()

    def adapter(self) -> "FakeCuda":
        """The observer's device: this stand-in."""
        return self

    @contextlib.contextmanager
    def placing(self) -> Iterator[None]:
        """``.to("cuda")``, ``torch.arange(..., device="cuda")`` and every other op asked for a
        ``device="cuda"`` result make device memory of this stand-in (on the CPU). Enter it before
        the observer starts: the observer's mode sees the op as it would on a GPU, then hands it here.
        A CPU build of torch refuses ``"cuda"`` in the Python call, so call the aten op it dispatches
        to: ``torch.ops.aten._to_copy.default(t, device=torch.device("cuda"), non_blocking=True)``."""
        with _Placing(self):
            yield


class _Placing(TorchDispatchMode):
    """See :meth:`FakeCuda.placing`."""

    def __init__(self, cuda: FakeCuda) -> None:
        super().__init__()
        self.cuda = cuda

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        target = kwargs.get("device")
        if target is None or torch.device(target).type != "cuda":
            return func(*args, **kwargs)
        kwargs["device"] = torch.device("cpu")
        kwargs.pop("pin_memory", None)
        result = func(*args, **kwargs)
        self.cuda.adopt(result)
        return result


def _elapsed_time(start: Any, end: Any) -> float:
    """``torch.Event.elapsed_time`` on the stand-in: torch's refusal of an event never recorded, else
    the milliseconds between two completed events (the stand-in's work is done as it is queued)."""
    if not (start.event_id and end.event_id):
        raise ValueError("Both events must be recorded before calculating elapsed time.")
    return 0.001


class _Immutable(type):
    """The metaclass of the stand-in's ``torch.Event`` and ``torch.Stream``: like torch's C types
    (immutable since Python 3.10), they refuse ``setattr``, so a tool cannot wrap their methods there."""

    def __setattr__(cls, name: str, value: Any) -> None:
        raise TypeError(f"cannot set {name!r} attribute of immutable type {cls.__qualname__!r}")


def _event_class(cuda: FakeCuda) -> type:
    class Event(torch._C.Event, metaclass=_Immutable):
        """``torch.Event`` on the stand-in (:meth:`FakeCuda.generic_types`): a CUDA event to the
        observer. ``event_id`` is 0 until the first record, as c10's ``cudaEvent_t`` is."""

        def __new__(cls, device: Any = None, *, enable_timing: bool = False, blocking: bool = False,
                    interprocess: bool = False) -> Any:
            event = super().__new__(cls, "cpu", enable_timing=enable_timing)
            event.handle = 0
            return event

        @property
        def device(self) -> torch.device:
            return torch.device("cuda")

        @property
        def event_id(self) -> int:
            return self.handle

        def record(self, stream: Any = None) -> None:
            self.handle = self.handle or next(cuda._ids)
            cuda._call(trace.event_recorded, self.handle, cuda.stream_id(stream))

        def wait(self, stream: Any = None) -> None:
            if self.handle:
                cuda.wait(self.handle, stream)

        def synchronize(self) -> None:
            if self.handle:
                cuda.synchronize_event(self.handle)

    return Event


def _stream_class(cuda: FakeCuda) -> type:
    class Stream(torch._C.Stream, metaclass=_Immutable):
        """``torch.Stream`` on the stand-in (:meth:`FakeCuda.generic_types`): a new stream to the observer."""

        def __new__(cls, device: Any = None, *, priority: int = 0) -> Any:
            stream = super().__new__(cls)
            stream.handle = cuda.new_stream()
            return stream

        @property
        def cuda_stream(self) -> int:
            return self.handle

        def synchronize(self) -> None:
            cuda.synchronize_stream(self.handle)

        def wait_event(self, event: Any) -> None:
            event.wait(self)

        def record_event(self, event: Any = None) -> Any:
            event = torch.Event() if event is None else event
            event.record(self)
            return event

    return Stream


class _FakeGraph:
    """A graph object for :meth:`FakeCuda.capture` (the observer keys its records by it)."""


class RealCuda:
    """The same calls on a real GPU (the tests run on both where there is one): device memory is
    CUDA memory, pinned memory is pinned, streams and events are torch's."""

    name = "cuda"

    def __init__(self) -> None:
        self.obs: Any = None

    def device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to("cuda")

    def pinned(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory()

    def new_stream(self) -> Any:
        return torch.cuda.Stream()

    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def record(self, stream: Any = None) -> Any:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, event: Any, stream: Any = None) -> None:
        (stream or torch.cuda.current_stream()).wait_event(event)

    def synchronize_event(self, event: Any) -> None:
        event.synchronize()

    def synchronize_stream(self, stream: Any) -> None:
        stream.synchronize()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def new_graph(self) -> Any:
        return torch.cuda.CUDAGraph()

    def capture(self, graph: Any) -> Any:
        return torch.cuda.graph(graph)

    def replay(self, graph: Any) -> None:
        graph.replay()

    def generic_types(self) -> Any:
        return contextlib.nullcontext()  # torch.Event and torch.Stream are CUDA's already

    def adapter(self) -> None:
        """The observer's device: its own (None: sanitizer.gpu.device.CudaDevice)."""
        return None
