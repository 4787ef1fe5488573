"""A stand-in for CUDA that the GPU observer can watch on a CPU: the observer's race logic in CI, and
the per-op cost benchmark (``python -m sanitizer.bench.op_cost``) on a machine without a GPU.

The observer asks its device (sanitizer/gpu/device.py) which tensors are device memory, which host
memory is pinned and which stream the calling thread is on. This stand-in answers for CPU tensors
it was told about: ``cuda.device(t)`` makes ``t`` device memory, ``cuda.pinned(t)`` pinned memory,
and the fresh outputs of ops on device tensors are device memory too. Streams and events are ids
whose calls go to the observer's trace handlers, as torch's GPU trace callbacks would. The ops
themselves run at once on the CPU: the observer's verdicts come from enqueue order and never from
when work runs, which is what makes this stand-in enough for them.

Why it lives in the product (it was tests/fake_cuda.py, which now re-exports it): the op-cost
benchmark is a product command, and the product may not import ``tests/``. Writing a second stand-in
for the benchmark would measure the observer against a device nobody tests; driving the observer
through private hooks instead would time a path the program never takes. So the benchmark and the
tests share this one, which holds no test logic (what a test checks stays in tests/).

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

import bisect
import contextlib
import itertools
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from racecheck.devices import names_cuda
from racecheck.lazy_dynamo import LazyDynamoMode, guard_once_dynamo_loaded
from racecheck.ops import decomposed, op_info
from racecheck.placement import Placed
from sanitizer.gpu import c_methods, trace
from sanitizer.gpu.device import CudaDevice
from sanitizer.sites import also_skip

also_skip(__file__)  # a stand-in for CUDA: its frames are not the program's

# What ``Tensor.pin_memory()`` dispatches to once it has found the tensor unpinned.
_PIN = {packet.default for packet in (getattr(torch.ops.aten, "_pin_memory", None),) if packet is not None}


class FakeCuda:
    name = "fake"

    def __init__(self) -> None:
        # storage address -> a weak reference to the storage, of the tensors that are device memory: an
        # address is forgotten when its storage is freed, since the CPU allocator soon hands it to a
        # pageable tensor, which the observer would then take for device memory (on a GPU the two
        # never share an address)
        self._device: dict[int, _Held] = {}
        self._sizes: dict[int, int] = {}  # storage address -> bytes, of the tensors made device memory
        self._starts: list[int] = []  # the same addresses, sorted: holding() bisects them
        self._pinned: dict[int, int] = {}  # first byte -> end of each pinned storage
        self._host_pool: dict[int, list[bytearray]] = {}  # bytes -> blocks of pin_copy, free or in use
        self._local = threading.local()
        self._ids = itertools.count(0x1000)
        self.obs: Any = None

    # -- memory --------------------------------------------------------------------------------------
    def device(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        self._hold(storage)
        address = storage.data_ptr()
        if address not in self._sizes:
            bisect.insort(self._starts, address)
        self._sizes[address] = storage.nbytes()
        return tensor
    def _hold(self, storage: Any) -> None:
        address = storage.data_ptr()
        held = self._device.get(address)
        if held is None or held() is not storage:
            self._device[address] = _Held(storage, self._freed, address)

    def _freed(self, held: "_Held") -> None:
        if self._device.get(held.address) is held:
            del self._device[held.address]
            if self._sizes.pop(held.address, None) is not None:
                self._starts.pop(bisect.bisect_left(self._starts, held.address))


    def holding(self, start: int, end: int) -> Placed | None:
        """The bytes of ``[start, end)`` in the device tensor's storage that holds ``start`` (a raw
        access): the nearest storage starting at or below ``start`` (live storages do not overlap),
        by bisection; empty storages hold no byte and are passed over."""
        starts, sizes = self._starts, self._sizes
        i = bisect.bisect_right(starts, start) - 1
        while i >= 0 and not sizes[starts[i]]:
            i -= 1
        if i < 0 or start >= starts[i] + sizes[starts[i]]:
            return None
        base = starts[i]
        return Placed(base, ("cudamem", base), "device", [(start, min(end, base + sizes[base]))])

    def is_pageable(self, address: int, size: int) -> bool:
        """Memory made neither device memory nor pinned here, as the driver answers for its first and
        last byte (:meth:`sanitizer.gpu.device.CudaDevice.is_pageable`): the CPU's own."""
        held = self.holding(address, address + size)
        if held is not None and held.end >= address + size:
            return False
        return not (self._in_pinned(address) or self._in_pinned(address + size - 1))

    def _in_pinned(self, address: int) -> bool:
        return any(start <= address < end for start, end in self._pinned.items())

    def pinned(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` is pinned memory, allocated here (as ``pin_memory=True`` is, to the observer)."""
        self._pin(tensor)
        if self.obs is not None:
            from sanitizer.sites import caller_site

            with self.obs.lock:
                self.obs.note_pinned(tensor, caller_site(), "pinned by the test")
        return tensor

    def pin_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A pinned copy of ``tensor`` (``tensor.pin_memory()``), in a block of the stand-in's own
        pool, as CUDA's host allocator keeps its blocks: pinned memory never shares an address with
        pageable memory, where a freed CPU tensor's address would soon be handed to a pageable one
        the observer then took for pinned. A block is reused once no tensor holds it."""
        nbytes = tensor.numel() * tensor.element_size()
        with torch._C.DisableTorchFunction():
            if nbytes == 0:
                return tensor.clone()
            pool = self._host_pool.setdefault(nbytes, [])
            # a free block is referred to by the pool, the loop and getrefcount's argument alone
            block = next((b for b in pool if sys.getrefcount(b) <= 3), None)
            if block is None:
                block = bytearray(nbytes)
                pool.append(block)
            result = torch.frombuffer(block, dtype=tensor.dtype).view(tensor.shape)
            result.copy_(tensor)
        self._pin(result)
        return result

    def _pin(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        self._pinned[storage.data_ptr()] = storage.data_ptr() + storage.nbytes()

    def is_device(self, tensor: torch.Tensor) -> bool:
        # A tensor that calls itself CUDA (the simulator's SimCudaTensor) is device memory, as
        # CudaDevice.is_device (tensor.is_cuda) would take it.
        return tensor.is_cuda or tensor.untyped_storage().data_ptr() in self._device

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self._pinned

    def adopt(self, tensor: torch.Tensor) -> None:
        self._hold(tensor.untyped_storage())

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
        ``device="cuda"`` result make device memory of this stand-in (on the CPU), and the caching
        allocator's trace callback says so, inside the op, as on a GPU. Enter it before the observer
        starts: the observer's mode sees the op as it would on a GPU, then hands it here. A CPU build
        of torch refuses ``"cuda"`` in the Python call of ``.to()`` and the factories, so call the aten
        op it dispatches to: ``torch.ops.aten._to_copy.default(t, device=torch.device("cuda"),
        non_blocking=True)``. ``torch.tensor``, ``torch.as_tensor``, ``torch.asarray`` and
        ``Tensor.new_tensor`` take a CUDA device here as a CUDA build does (:class:`_Constructors`).
        Under ``torch.inference_mode()`` a mode gets ``aten.to.dtype_layout``, ``aten.to.device`` and
        ``aten.pin_memory`` whole, and decomposes them (:func:`racecheck.ops.decomposed`); a CPU build's
        decomposition refuses a CUDA target, so here they decompose as :class:`_Composites` says."""
        with _Placing(self), _Constructors(self), _Composites(self):
            yield

    def allocated(self, tensor: torch.Tensor) -> None:
        """The caching allocator handed ``tensor``'s memory out: its trace callback."""
        self.adopt(tensor)
        self._call(trace.memory_allocated, tensor.untyped_storage().data_ptr())


class _Placing(LazyDynamoMode):
    """See :meth:`FakeCuda.placing`. A :class:`~racecheck.lazy_dynamo.LazyDynamoMode`, as the
    observer's own modes are: a plain dispatch mode would import ``torch._dynamo`` at its first op,
    and the observer's modes would then pay dynamo's per-op guard, which they do not on a GPU."""

    def __init__(self, cuda: FakeCuda) -> None:
        super().__init__()
        self.cuda = cuda

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        guard_once_dynamo_loaded(_Placing)
        if op_info(func).composite:  # under torch.inference_mode(): x.to("cuda") whole, as on a GPU
            result = decomposed(self, func, args, kwargs or {})
            if result is not NotImplemented:
                return result
        if func in _PIN:  # ``t.pin_memory()`` (a CPU build refuses it): a pinned copy, as CUDA's would be
            return self.cuda.pin_copy(args[0])
        kwargs = dict(kwargs or {})
        target = kwargs.get("device")
        if target is None or torch.device(target).type != "cuda":
            result = func(*args, **kwargs)
            inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            if any(self.cuda.is_device(t) for t in inputs):  # a fresh output of a device op: allocated
                storages = {t.untyped_storage().data_ptr() for t in inputs}
                for out in tree_flatten(result)[0]:
                    if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() not in storages:
                        self.cuda.allocated(out)
            return result
        kwargs["device"] = torch.device("cpu")
        kwargs.pop("pin_memory", None)
        result = func(*args, **kwargs)
        if isinstance(result, torch.Tensor):
            self.cuda.allocated(result)
        return result


class _Composites:
    """Python decompositions, while the stand-in places, of the composite ops that ``Tensor.to`` and
    ``Tensor.pin_memory`` dispatch to, as a CUDA build's C++ ones behave: ``to`` is its argument where
    nothing would change (a CUDA target for a tensor that already is the stand-in's device memory,
    the same dtype, layout and memory format) and ``aten._to_copy`` otherwise; ``pin_memory`` is its
    argument where it is pinned, else ``aten._pin_memory``. ``OpOverload.decompose`` takes a Python
    kernel registered for ``CompositeImplicitAutograd`` before the C++ one, which on a CPU build
    refuses a CUDA device before it dispatches anything."""

    _KEY = torch._C.DispatchKey.CompositeImplicitAutograd

    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda
        self._added: list[Any] = []

    def __enter__(self) -> "_Composites":
        aten, cuda = torch.ops.aten, self.cuda
        kernels = {
            aten.to.dtype_layout: lambda t, *, dtype=None, layout=None, device=None, pin_memory=None,
            non_blocking=False, copy=False, memory_format=None: self._to(
                t, dtype, layout, device, pin_memory, non_blocking, copy, memory_format),
            aten.to.device: lambda t, device, dtype, non_blocking=False, copy=False, memory_format=None: self._to(
                t, dtype, None, device, None, non_blocking, copy, memory_format),
            aten.to.dtype: lambda t, dtype, non_blocking=False, copy=False, memory_format=None: self._to(
                t, dtype, None, None, None, non_blocking, copy, memory_format),
            aten.to.other: lambda t, other, non_blocking=False, copy=False, memory_format=None: self._to(
                t, other.dtype, None, torch.device("cuda") if cuda.is_device(other) else other.device, None,
                non_blocking, copy, memory_format),
            aten.pin_memory.default: lambda t, device=None: t if cuda.is_pinned(t) else aten._pin_memory.default(t),
        }
        for op, kernel in kernels.items():
            if self._KEY not in op.py_kernels:
                op.py_kernels[self._KEY] = kernel
                self._added.append(op)
        return self

    def __exit__(self, *exc: Any) -> None:
        for op in self._added:
            op.py_kernels.pop(self._KEY, None)
        self._added.clear()

    def _to(self, t: torch.Tensor, dtype: Any, layout: Any, device: Any, pin_memory: Any, non_blocking: bool,
            copy: bool, memory_format: Any) -> torch.Tensor:
        on_device = self.cuda.is_device(t)
        same_side = device is None or (torch.device(device).type == "cuda") == on_device
        if (not copy and same_side and dtype in (None, t.dtype) and layout in (None, t.layout)
                and (memory_format in (None, torch.preserve_format) or t.is_contiguous(memory_format=memory_format))):
            return t
        return torch.ops.aten._to_copy.default(t, dtype=dtype, layout=layout, device=device, pin_memory=pin_memory,
                                               non_blocking=non_blocking, memory_format=memory_format)


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


def _dispatched(name: str, data: Any) -> bool:
    """Whether a CUDA build moves ``data`` with a ``.to()`` the modes see (tensor_new.cpp: a tensor,
    a numpy array, or for ``asarray`` a numpy scalar or a buffer, come to a tensor first)."""
    if isinstance(data, (torch.Tensor, np.ndarray)):
        return True
    if name != "asarray":
        return False
    if isinstance(data, np.generic):
        return True
    try:
        memoryview(data)
    except TypeError:
        return False
    return True


class _Constructors:
    """What a CUDA build of torch does for ``torch.tensor(data, device="cuda")``, ``as_tensor``,
    ``asarray`` and ``new_tensor`` (torch/csrc/utils/tensor_new.cpp, ``internal_new_from_data`` and
    ``asarray``): from a tensor, a numpy array or (``asarray``) a buffer, a host tensor and then a
    ``.to(device)`` every mode sees; from a list, a tuple or a scalar, the host tensor and its move
    with every Python mode excluded (the allocation and the blocking copy's stream synchronisation
    still reach the trace callbacks), then a ``lift_fresh`` the modes see."""

    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda
        self.saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> "_Constructors":
        for owner, name in ((torch, "tensor"), (torch, "as_tensor"), (torch, "asarray"), (torch.Tensor, "new_tensor")):
            original = getattr(owner, name)
            self.saved.append((owner, name, original))
            setattr(owner, name, self._model(original, name))
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, original in reversed(self.saved):
            setattr(owner, name, original)
        self.saved.clear()

    def _model(self, original: Any, name: str) -> Any:
        cuda = self.cuda

        def call(*args: Any, **kwargs: Any) -> Any:
            method = name == "new_tensor"
            base = args[0] if method else None
            rest = list(args[1:] if method else args)
            data = rest.pop(0) if rest else kwargs.pop("data", kwargs.pop("obj", None))
            device = kwargs.get("device")
            if device is None and name == "as_tensor" and len(rest) > 1:
                device = rest[1]
            if device is None and method and kwargs.get("device") is None and cuda.is_device(base):
                device = "cuda"
            if not names_cuda(device):
                return original(*args, **kwargs)
            dtype = kwargs.get("dtype") or (rest[0] if name == "as_tensor" and rest else None)
            if dtype is None and method:
                dtype = base.dtype
            requires_grad = bool(kwargs.get("requires_grad", False))
            host_args = (base, data) if method else (data,)
            if _dispatched(name, data):
                host = original(*host_args, dtype=dtype, device="cpu")
                result = torch.ops.aten._to_copy.default(host, device=torch.device("cuda"))  # seen by the modes
            else:
                with _disable_current_modes(), torch._C.DisableTorchFunction():
                    result = original(*host_args, dtype=dtype, device="cpu").clone()
                cuda.allocated(result)
                cuda._call(trace.stream_synchronized, cuda.current_stream())  # the blocking copy
                result = torch.ops.aten.lift_fresh.default(result)
            if requires_grad:
                result.requires_grad_(True)
            return result

        return call


class _Held(weakref.ref):
    """A weak reference to a device storage, carrying its address for :meth:`FakeCuda._freed`."""

    __slots__ = ("address",)

    def __new__(cls, storage: Any, callback: Any, address: int) -> "_Held":
        return super().__new__(cls, storage, callback)

    def __init__(self, storage: Any, callback: Any, address: int) -> None:
        super().__init__(storage, callback)
        self.address = address


class _FakeGraph:
    """A graph object for :meth:`FakeCuda.capture` (the observer keys its records by it)."""
