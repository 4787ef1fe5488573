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

import contextlib
import itertools
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from racecheck.lazy_dynamo import LazyDynamoMode, guard_once_dynamo_loaded
from sanitizer.gpu import trace
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
        self._pinned: set[int] = set()
        self._host_pool: dict[int, list[bytearray]] = {}  # bytes -> blocks of pin_copy, free or in use
        self._local = threading.local()
        self._ids = itertools.count(0x1000)
        self.obs: Any = None

    # -- memory --------------------------------------------------------------------------------------
    def device(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        self._hold(storage)
        self._sizes[storage.data_ptr()] = storage.nbytes()
        return tensor

    def _hold(self, storage: Any) -> None:
        address = storage.data_ptr()
        held = self._device.get(address)
        if held is None or held() is not storage:
            self._device[address] = _Held(storage, self._freed, address)

    def _freed(self, held: "_Held") -> None:
        if self._device.get(held.address) is held:
            del self._device[held.address]
            self._sizes.pop(held.address, None)

    def allocation_at(self, address: int, size: int) -> int | None:
        """The device tensor's storage holding ``[address, address + size)`` (a raw access)."""
        return next((b for b, n in self._sizes.items() if b <= address and address + size <= b + n), None)

    def pinned(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` is pinned memory, allocated here (as ``pin_memory=True`` is, to the observer)."""
        self._pinned.add(tensor.untyped_storage().data_ptr())
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
        self._pinned.add(result.untyped_storage().data_ptr())
        return result

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
    def stream(self, stream: int) -> Iterator[None]:
        previous = self.current_stream()
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = previous

    def record(self, stream: int | None = None) -> int:
        event = next(self._ids)
        self._call(trace.event_recorded, event, self.current_stream() if stream is None else stream)
        return event

    def wait(self, event: int, stream: int | None = None) -> None:
        self._call(trace.event_waited, event, self.current_stream() if stream is None else stream)

    def synchronize_event(self, event: int) -> None:
        self._call(trace.event_synchronized, event)

    def synchronize_stream(self, stream: int) -> None:
        self._call(trace.stream_synchronized, stream)

    def synchronize(self) -> None:
        self._call(trace.device_synchronized)

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
        to: ``torch.ops.aten._to_copy.default(t, device=torch.device("cuda"), non_blocking=True)``;
        likewise ``torch.ops.aten._pin_memory.default(t)`` for ``t.pin_memory()``: a pinned copy, which
        the observer notes as the allocation it is on a GPU."""
        with _Placing(self):
            yield


class _Placing(LazyDynamoMode):
    """See :meth:`FakeCuda.placing`. A :class:`~racecheck.lazy_dynamo.LazyDynamoMode`, as the
    observer's own modes are: a plain dispatch mode would import ``torch._dynamo`` at its first op,
    and the observer's modes would then pay dynamo's per-op guard, which they do not on a GPU."""

    def __init__(self, cuda: FakeCuda) -> None:
        super().__init__()
        self.cuda = cuda

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        guard_once_dynamo_loaded(_Placing)
        if func in _PIN:  # ``t.pin_memory()`` (a CPU build refuses it): a pinned copy, as CUDA's would be
            return self.cuda.pin_copy(args[0])
        if not kwargs or kwargs.get("device") is None:
            return func(*args, **(kwargs or {}))
        kwargs = dict(kwargs)
        if torch.device(kwargs["device"]).type != "cuda":
            return func(*args, **kwargs)
        kwargs["device"] = torch.device("cpu")
        kwargs.pop("pin_memory", None)
        result = func(*args, **kwargs)
        self.cuda.adopt(result)
        return result


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
