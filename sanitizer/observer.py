"""The sanitizer on a GPU: the program's own schedule, observed, never changed (observe mode).

Nothing the program calls is replaced: its streams and events stay torch's, every op runs where
torch runs it. The sanitizer watches through three windows and feeds one happens-before checker
(:class:`racecheck.hb.HappensBefore`, the same one the fuzzer uses):

* a ``TorchDispatchMode`` sees every aten op with the tensors it reads and writes (the schema's
  ``(a!)`` arguments and fresh outputs are writes), on the stream torch is about to use, and the
  pinned allocations (their site is the buffer's allocation site in a report);
* torch's GPU trace callbacks (``torch.cuda._gpu_trace``, what ``TORCH_CUDA_SANITIZER`` also
  uses) see stream creation, event record and wait, every event, stream and device
  synchronisation, and the caching allocator handing memory out;
* a few patches, put back on :meth:`Observer.stop`: ``torch.cuda.Event.query`` and
  ``torch.cuda.Stream.query`` (a True answer is the host observing completion; torch traces no
  query), ``Tensor.numpy`` (where a pinned buffer's numpy view was taken: vLLM writes staging
  through one), ``torch.cuda.empty_cache`` (memory given back to CUDA is reused only after a device
  synchronisation) and Triton's ``JITFunction.run`` (a launch reads its tensor arguments and writes
  those that reach a ``tl.store``: :func:`zeroer.intercept.triton_launch.stored_params`).

Host writes to pinned memory are not calls at all (``buf.numpy()[:n] = ids``): each queued read of
pinned memory keeps a copy of the bytes it will read and a reference to the buffer (so the host
allocator cannot recycle it under the check), and at every op, trace callback and scope end the
bytes of the reads the host has not seen complete are compared with that copy. A difference is a
host write under a pending copy, reported between the two program lines it was seen between (or at
the numpy view it went through).

Verdicts come from enqueue order, never from timing: a race is reported on a run where the values
came out right. :mod:`sanitizer.forcing` can also make them come out wrong (force mode).

Example (needs a GPU)::

    obs = Observer()
    obs.start()
    main()                      # the program
    races = obs.stop()
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from sanitizer.races import Access, Race
from sanitizer.sites import Site, caller_site
from racecheck.ops import aliased_returns, kind, written_args
from zeroer.intercept.sim_tensor import SimCudaTensor
from zeroer.origin import forwarding
from racecheck.hb import HappensBefore, Hazard, OpStamp

aten = torch.ops.aten
_PIN = {op for op in (getattr(aten, "_pin_memory", None), getattr(aten, "pin_memory", None)) if op is not None}
_PIN = {getattr(packet, "default") for packet in _PIN if hasattr(packet, "default")}
_SCALAR = getattr(aten._local_scalar_dense, "default")
_AS_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_EMPTY = np.empty(0, dtype=np.uint8)
MAX_PENDING = 4096  # pending pinned reads kept; beyond it the oldest are dropped (a miss, never a false race)


class _Label(str):
    """An op's label in the checker, carrying what the report says about it."""

    access: Access
    generations: dict[int, int]  # device address -> its allocation count when this op used it

    @classmethod
    def of(cls, text: str, access: Access) -> "_Label":
        label = cls(text)
        label.access, label.generations = access, {}
        return label


@dataclass(eq=False)
class _PendingRead:
    key: tuple
    view: torch.Tensor  # keeps the pinned storage alive: the host allocator cannot recycle it
    snapshot: np.ndarray
    stamp: OpStamp
    resource: str
    allocated_at: Site | None
    span: tuple[int, int] | None = None  # (address, bytes) of a contiguous view: compared as raw bytes
    raw: bytes = b""

    def staged(self) -> np.ndarray:
        """The bytes this read was queued with, as :func:`_ints` gives a view's elements."""
        if self.span is None:
            return self.snapshot
        size = self.view.element_size()
        integer = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}.get(size)
        if self.view.dtype.is_complex or integer is None:
            return np.frombuffer(self.raw, dtype=np.uint8)
        return np.frombuffer(self.raw, dtype=integer).reshape(tuple(self.view.shape))

    def changed(self) -> bool:
        if self.span is not None:
            return ctypes.string_at(*self.span) != self.raw
        return not np.array_equal(_ints(self.view), self.snapshot)

    def only_ours(self) -> bool:
        """Whether nothing but this record holds the buffer: the program cannot write it any more."""
        if _USE_COUNT is None:
            return False
        return _USE_COUNT(self.view.untyped_storage()._cdata) <= 2  # our alias and the temporary storage


@dataclass(frozen=True)
class Unfollowed:
    """Something the program did that the sanitizer cannot follow, and where."""

    what: str
    site: Site

    def message(self) -> str:
        return f"kvz-sanitize cannot follow {self.what} at {self.site}"


def _ints(view: torch.Tensor) -> np.ndarray:
    """``view``'s elements as same-width integers (bytes compare exactly, NaN included)."""
    with _disable_current_modes():
        size = view.element_size()
        if view.dtype.is_complex or size not in _AS_INT:
            return view.detach().contiguous().view(torch.uint8).numpy()
        as_int = view if view.dtype == _AS_INT[size] else view.detach().view(_AS_INT[size])
        return _ORIGINAL_NUMPY(as_int.detach())


def shown_values(array: np.ndarray, dtype: torch.dtype, limit: int = 8) -> str:
    """A few of ``array``'s elements (same-width integers of ``dtype``) as ``dtype`` values."""
    flat = array.reshape(-1)
    numpy_dtype = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}.get(dtype)
    values = flat.view(numpy_dtype) if numpy_dtype is not None else flat
    shown = ", ".join(str(v) for v in values[:limit].tolist())
    return f"[{shown}{', ...' if flat.size > limit else ''}]"


_ORIGINAL_NUMPY = torch.Tensor.numpy
_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


class _Ops(TorchDispatchMode):
    """Every aten op, seen on its way to torch (the module docstring says what is recorded)."""

    def __init__(self, observer: "Observer") -> None:
        super().__init__()
        self.obs = observer

    @forwarding  # the program's own call, handed on: what torch raises under it is the program's
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        obs = self.obs
        if obs.paused or threading.get_ident() != obs.thread_id:
            return func(*args, **kwargs)
        return obs.on_op(func, args, kwargs)


class Observer:
    """The sanitizer's state for one process; see the module docstring."""

    def __init__(self, *, forcing: Any = None) -> None:
        self.hb = HappensBefore()
        self.forcing = forcing  # sanitizer.forcing.Forcing in force mode, else None
        self.races: list[Race] = []
        self.unfollowed: list[Unfollowed] = []
        self._busy = False  # the sanitizer's own CUDA work (force mode's gates) is under way
        self._harness: weakref.WeakSet = weakref.WeakSet()  # live runtimes of kvzero's own harness
        self.thread_id = threading.get_ident()
        self._threads: dict[int, int] = {}  # cudaStream_t -> checker thread
        self._stream_names: dict[int, str] = {}
        self._events: dict[int, tuple[int, ...]] = {}  # cudaEvent_t -> clock snapshot at its record
        self._pinned: dict[int, tuple[str, Site | None]] = {}  # storage address -> (description, site)
        self._numpy_at: dict[int, Site] = {}  # storage address -> where its numpy view was last taken
        self._pending: list[_PendingRead] = []
        self._device_written: set[int] = set()  # pinned storages a queued D2H copy writes
        self._alloc_stream: dict[int, int] = {}  # device address -> stream it was last handed out on
        self._generation: dict[int, int] = {}
        self._recorded: set[int] = set()  # device addresses record_stream tied to another stream
        self._ops = 0
        self._last_site: Site | None = None
        self._mode = _Ops(self)
        self._patches: list[tuple[Any, str, Any]] = []
        self._hazards_seen = 0
        self._capturing_noted = False
        self._device_sites: dict[int, Site] = {}  # device address -> where it was last handed out
        self._named: set[int] = set()

    @property
    def paused(self) -> bool:
        """Whether what happens now is not the program's to check: the sanitizer's own work, or
        kvzero's harness running a zeroer on its own schedule (:meth:`harness_started`)."""
        return self._busy or bool(self._harness)

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        global _ACTIVE
        # torch imports its compiler stack (torch._dynamo, a second or more) on the first op that
        # passes a Python dispatch mode (torch/_compile.py); importing it now makes that one-time
        # cost part of the sanitizer's start, not of whichever test comes first.
        import torch._dynamo  # noqa: F401
        _install_trace_callbacks()
        self._patch_all()
        self._mode.__enter__()
        _ACTIVE = self

    def stop(self) -> list[Race]:
        """Stop observing; the races seen (a final host check and the forced releases first)."""
        global _ACTIVE
        try:
            self.scope_end(caller_site())
        finally:
            _ACTIVE = None
            self._mode.__exit__(None, None, None)
            for owner, name, original in reversed(self._patches):
                setattr(owner, name, original)
            self._patches = []
            if self.forcing is not None:
                self.forcing.close()
        return self.races

    def scope_end(self, site: Site) -> None:
        """A test (or the program) ended: release what force mode holds, check the host once more."""
        self.check_host(site)
        self._release(site)

    def take_races(self) -> list[Race]:
        races, self.races = self.races, []
        return races

    def take_unfollowed(self) -> list[Unfollowed]:
        notes, self.unfollowed = self.unfollowed, []
        return notes

    # -- streams and labels ------------------------------------------------------------------------
    def _thread(self, stream: int) -> int:
        thread = self._threads.get(stream)
        if thread is None:
            name = self._stream_names.get(stream) or (
                "the default stream" if stream == 0 else f"stream 0x{stream:x}"
            )
            self._stream_names[stream] = name
            thread = self._threads[stream] = self.hb.add_stream(name)
        return thread

    def _current_stream(self, device: int | None) -> int:
        return _raw_stream(device)  # torch._C calls, no aten op: safe inside and outside the mode

    def _label(self, what: str, stream: int, site: Site | None) -> _Label:
        self._ops += 1
        self._thread(stream)
        access = Access(what, self._stream_names[stream], site)
        return _Label.of(f"{what}#{self._ops}", access)

    def _enqueue(self, what: str, stream: int, site: Site | None) -> OpStamp:
        return self.hb.enqueue(self._thread(stream), self._label(what, stream, site))

    # -- aten ops ----------------------------------------------------------------------------------
    @forwarding
    def on_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        tensors = _tensors(args, kwargs)
        if any(type(t) is not torch.Tensor and isinstance(t, SimCudaTensor) for t in tensors):
            return func(*args, **kwargs)  # kvzero's simulator at work (its "cuda" is CPU memory)
        cuda = [t for t in tensors if t.is_cuda]
        device = kwargs.get("device")
        to_cuda = device is not None and torch.device(device).type == "cuda"
        if not cuda and not to_cuda:
            return self._host_op(func, args, kwargs, tensors)
        site = caller_site()
        if self._pending:
            self.check_host(site)
        self._last_site = site
        if torch.cuda.is_current_stream_capturing():
            self._note_capture(site)
            return func(*args, **kwargs)
        what = kind(func)
        if what in ("view", "alloc"):
            return func(*args, **kwargs)
        if func is aten.record_stream.default:
            self._recorded.add(args[0].untyped_storage().data_ptr())
            return func(*args, **kwargs)
        index = cuda[0].device.index if cuda else torch.device(device).index
        stream = self._current_stream(index)
        if what in ("copy", "to_copy"):
            return self._copy(func, args, kwargs, what, stream, site)
        if what == "blocking" or func is _SCALAR:
            self._release(site)  # the host waits for the stream here: forced holds must open first
        stamp = self._enqueue(_op_name(func), stream, site)
        written = self._written(func, args, kwargs)
        for tensor in cuda:
            if not any(tensor is w for w in written):
                self._device(tensor, stamp, write=False)
        result = func(*args, **kwargs)
        for tensor in written:
            self._device(tensor, stamp, write=True)
        for out in self._fresh_outputs(func, result):
            self._device(out, stamp, write=True)
        if what == "blocking" or func is _SCALAR:
            self.hb.host_observes_stream(self._thread(stream))
        return result

    def _written(self, func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        positional = list(args) + [kwargs.get(a.name) for a in func._schema.arguments[len(args):]]
        written: list[torch.Tensor] = []
        for i in _written_positions(func):
            value = positional[i] if i < len(positional) else None
            for tensor in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
                    written.append(tensor)
        return written

    def _fresh_outputs(self, func: Any, result: Any) -> list[torch.Tensor]:
        aliased = _aliased(func)
        outputs = result if isinstance(result, (tuple, list)) else (result,)
        return [o for i, o in enumerate(outputs) if isinstance(o, torch.Tensor) and o.is_cuda
                and (i >= len(aliased) or aliased[i] is None)]

    def _device(self, tensor: torch.Tensor, stamp: OpStamp, *, write: bool) -> None:
        address = tensor.untyped_storage().data_ptr()
        if address == 0:
            return  # an empty tensor: no memory
        label = stamp.label
        if isinstance(label, _Label):
            label.generations[address] = self._generation.get(address, 0)
        if address not in self._named:
            self._named.add(address)
            self.hb.name_resource(("cudamem", address), f"device memory at 0x{address:x}")
        self.hb.device_access(("cudamem", address), stamp, write=write)
        self._collect()

    @forwarding
    def _host_op(self, func: Any, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> Any:
        if kwargs.get("pin_memory") or func in _PIN:
            site = caller_site()
            self._release(site)  # pinned allocation may wait for the GPU (racecheck.gate)
            result = func(*args, **kwargs)
            if isinstance(result, torch.Tensor) and result.device.type == "cpu":
                self._note_pinned(result, site, _op_name(func))
            return result
        if not self._pending:
            return func(*args, **kwargs)
        written = self._written_host(func, args, kwargs)
        pending = self._pending_keys()
        if not any(w.untyped_storage().data_ptr() in pending for w in written):
            return func(*args, **kwargs)
        site = caller_site()
        self.check_host(site)  # what the host wrote before this op, in the window up to it
        self._last_site = site
        result = func(*args, **kwargs)
        self.check_host(site, exact=True)  # this torch op wrote pinned memory under a pending copy
        return result

    def _written_host(self, func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        positional = list(args) + [kwargs.get(a.name) for a in func._schema.arguments[len(args):]]
        return [positional[i] for i in _written_positions(func)
                if i < len(positional) and isinstance(positional[i], torch.Tensor)]

    def _pending_keys(self) -> set[int]:
        return {p.key[1] for p in self._pending}

    def _note_pinned(self, tensor: torch.Tensor, site: Site, how: str) -> None:
        address = tensor.untyped_storage().data_ptr()
        description = f"pinned host buffer {tuple(tensor.shape)} {str(tensor.dtype).replace('torch.', '')} ({how})"
        self._pinned[address] = (description, site)
        self._numpy_at.pop(address, None)
        self._device_written.discard(address)

    # -- copies ------------------------------------------------------------------------------------
    @forwarding
    def _copy(self, func: Any, args: tuple, kwargs: dict, what: str, stream: int, site: Site) -> Any:
        """``copy_(dst, src)`` or ``_to_copy(src)``: what the host waits for and what it may not touch."""
        if what == "copy":
            dst, src = args[0], args[1]
            non_blocking = bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False))
            device_dst = dst.is_cuda
        else:
            dst, src = None, args[0]
            non_blocking = bool(kwargs.get("non_blocking", False))
            target = kwargs.get("device")
            device_dst = src.is_cuda if target is None else torch.device(target).type == "cuda"
        h2d, d2h = not src.is_cuda and device_dst, src.is_cuda and not device_dst
        pinned_src = h2d and non_blocking and _is_pinned(src)
        pinned_dst = d2h and non_blocking and (dst is None or _is_pinned(dst))
        # CUDA returns from a copy with pageable host memory only once the host side is done with it;
        # a blocking copy waits for the stream (torch synchronises it).
        host_waits = (h2d and not non_blocking) or (d2h and not pinned_dst)
        how = ("non-blocking H2D copy" if pinned_src else "H2D copy") if h2d else \
              ("non-blocking D2H copy" if pinned_dst else "D2H copy") if d2h else "D2D copy"
        if host_waits:
            self._release(site)
        held = None
        if pinned_src and self.forcing is not None:
            held = self._hold(stream, dst if dst is not None else src)
        stamp = self._enqueue(f"{_op_name(func)} ({how})", stream, site)
        if src.is_cuda:
            self._device(src, stamp, write=False)
        result = func(*args, **kwargs)
        target_tensor = dst if dst is not None else result
        if isinstance(target_tensor, torch.Tensor) and target_tensor.is_cuda:
            self._device(target_tensor, stamp, write=True)
        if pinned_src:
            pending = self._note_read(src, stamp)
            if held is not None and pending is not None:
                self.forcing.watch(held, pending)
        if pinned_dst and isinstance(target_tensor, torch.Tensor):
            address = target_tensor.untyped_storage().data_ptr()
            self._device_written.add(address)  # its bytes change under the host: not a host write
            self._pending = [p for p in self._pending if p.key[1] != address]
        if host_waits:
            self.hb.host_observes_stream(self._thread(stream))
        return result

    def _hold(self, stream: int, tensor: torch.Tensor) -> Any:
        self._busy = True
        try:
            with _disable_current_modes():
                index = tensor.device.index if tensor.is_cuda else None
                return self.forcing.hold(torch.cuda.current_stream(index))
        finally:
            self._busy = False

    def _note_read(self, view: torch.Tensor, stamp: OpStamp) -> _PendingRead | None:
        """A queued op (``stamp``) reads pinned ``view`` when its stream reaches it."""
        address = view.untyped_storage().data_ptr()
        if address in self._device_written:
            return None
        description, allocated = self._pinned.get(
            address, (f"pinned host buffer at 0x{address:x} (allocated before the sanitizer started)", None))
        key = ("pinned", address)
        # Our own alias, not the program's tensor object: only_ours() counts the storage's holders,
        # and holding the program's own tensor would make the program's reference look like ours.
        with _disable_current_modes():
            view = view.detach()
        self.hb.name_resource(key, description)
        self.hb.copy_reads_host(key, stamp)
        if view.is_contiguous():
            span = (view.data_ptr(), view.numel() * view.element_size())
            pending = _PendingRead(key, view, _EMPTY, stamp, description, allocated, span, ctypes.string_at(*span))
        else:
            pending = _PendingRead(key, view, _ints(view).copy(), stamp, description, allocated)
        self._pending.append(pending)
        if len(self._pending) > MAX_PENDING:
            self._pending = self._pending[-MAX_PENDING:]
        return pending

    # -- host writes -------------------------------------------------------------------------------
    def check_host(self, site: Site, *, exact: bool = False) -> None:
        """Compare the bytes every pending read will see with what they were when it was queued."""
        if not self._pending:
            return
        still: list[_PendingRead] = []
        written: set[tuple] = set()
        for read in self._pending:
            if read.key in written or self.hb.host_has_seen(read.stamp):
                continue
            if read.changed():
                written.add(read.key)
                self._host_write(read, site, exact)
                continue
            if read.only_ours():
                self.hb.forget(read.key)  # dropped by the program unchanged: nothing can write it now
                continue
            still.append(read)
        self._pending = [p for p in still if p.key not in written]

    def _host_write(self, read: _PendingRead, site: Site, exact: bool) -> None:
        address = read.key[1]
        numpy_site = self._numpy_at.get(address)
        if exact:
            access = Access("host write (a torch op on the pinned buffer)", "the host", site)
        elif numpy_site is not None:
            access = Access("host write through the buffer's numpy view", "the host", numpy_site, until=site)
        else:
            access = Access("host write", "the host", self._last_site, until=site)
        self.hb.host_write(read.key, _Label.of("host write", access))
        self._collect()

    def note_numpy(self, tensor: torch.Tensor, site: Site) -> None:
        address = tensor.untyped_storage().data_ptr()
        if address in self._pinned or any(p.key[1] == address for p in self._pending):
            self.check_host(site)
            self._numpy_at[address] = site
        self._last_site = site

    # -- Triton ------------------------------------------------------------------------------------
    def on_triton(self, jit: Any, args: tuple, kwargs: dict, site: Site) -> Callable[[], None] | None:
        """A Triton launch about to be issued; returns what to call once it has been."""
        from zeroer.intercept.triton_launch import stored_params

        names = list(getattr(jit, "arg_names", []))
        bound = dict(zip(names, args))
        bound.update({k: v for k, v in kwargs.items() if k in names})
        tensors = [(n, v) for n, v in bound.items() if isinstance(v, torch.Tensor)]
        if any(isinstance(v, SimCudaTensor) for _, v in tensors):
            return None  # a launch on kvzero's simulator
        cuda = [(n, v) for n, v in tensors if v.is_cuda]
        pinned = [v for _, v in tensors if not v.is_cuda and _is_pinned(v)]
        if not cuda and not pinned:
            return None
        if self._pending:
            self.check_host(site)
        self._last_site = site
        if torch.cuda.is_current_stream_capturing():
            self._note_capture(site)
            return None
        if self.forcing is not None and self.forcing.first_launch(jit):
            self._release(site)  # loading a new kernel module waits for the GPU to drain
        device = cuda[0][1].device.index if cuda else None
        stream = self._current_stream(device)
        held = None
        if pinned and self.forcing is not None:
            held = self._hold(stream, cuda[0][1] if cuda else pinned[0])
        stamp = self._enqueue(f"Triton kernel {getattr(jit, '__name__', 'kernel')}", stream, site)
        stored = stored_params(jit.fn)
        for name, tensor in cuda:
            self._device(tensor, stamp, write=name in stored)
        for tensor in pinned:
            pending = self._note_read(tensor, stamp)
            if held is not None and pending is not None:
                self.forcing.watch(held, pending)
        return None

    # -- trace callbacks ---------------------------------------------------------------------------
    def stream_created(self, stream: int) -> None:
        site = caller_site()
        self._stream_names[stream] = f"stream 0x{stream:x} (created at {site.short})"

    def event_recorded(self, event: int, stream: int) -> None:
        self._boundary()
        thread = self._thread(stream)
        self.hb.enqueue(thread, self._label("event record", stream, None))
        self._events[event] = self.hb.snapshot(thread)

    def event_waited(self, event: int, stream: int) -> None:
        self._boundary()
        thread = self._thread(stream)
        self.hb.enqueue(thread, self._label("event wait", stream, None))
        self.hb.stream_waits(thread, self._events.get(event))

    def event_deleted(self, event: int) -> None:
        self._events.pop(event, None)

    def _boundary(self) -> Site | None:
        """A trace callback: the host code since the last boundary is checked (before any sync it
        reports makes earlier copies count as seen)."""
        if not self._pending and (self.forcing is None or not self.forcing.holding):
            return None
        site = caller_site()
        self.check_host(site)
        self._last_site = site
        return site

    def event_synchronized(self, event: int) -> None:
        self._release(self._boundary())
        self.hb.host_observes(self._events.get(event))

    def event_completed(self, event: int) -> None:
        """``Event.query()`` answered True: the host has seen everything the event covers."""
        self.hb.host_observes(self._events.get(event))

    def stream_synchronized(self, stream: int) -> None:
        self._release(self._boundary())
        self.hb.host_observes_stream(self._thread(stream))

    def stream_completed(self, stream: int) -> None:
        self.hb.host_observes_stream(self._thread(stream))

    def device_synchronized(self) -> None:
        self._release(self._boundary())
        self.hb.host_observes_all()

    def memory_allocated(self, address: int) -> None:
        """The caching allocator handed ``address`` out. It reuses memory on the stream that freed it
        without waiting for other streams, unless ``record_stream`` tied the block to them (then it
        waited for their events): only in that case, or when the block came back through CUDA on
        another stream (a device synchronisation), does the address start a fresh history."""
        stream = self._current_stream(None)
        previous = self._alloc_stream.get(address)
        if address in self._recorded or (previous is not None and previous != stream):
            self.hb.forget(("cudamem", address))
            self._recorded.discard(address)
        self._alloc_stream[address] = stream
        self._generation[address] = self._generation.get(address, 0) + 1
        site = caller_site()
        self._device_sites[address] = site

    def cache_emptied(self) -> None:
        """``torch.cuda.empty_cache()``: freed blocks go back to CUDA, which reuses them only after a
        device synchronisation; every device address starts a fresh history."""
        self.hb.host_observes_all()
        for address in list(self._alloc_stream):
            self.hb.forget(("cudamem", address))
        self._alloc_stream.clear()

    # -- kvzero's own harness ----------------------------------------------------------------------
    def harness_started(self, runtime: Any, site: Site) -> None:
        """A CUDA runtime of kvzero's fuzz harness starts (zeroer.runtime.cuda). It issues the
        zeroer's work on its own schedule, holding streams behind gate kernels that spin on flags the
        host writes: an order no torch hook shows, so checking it would report races that its gates
        prevent. The sanitizer steps aside until the last such runtime closes (the harness checks
        that work itself, with the same happens-before checker)."""
        if not self._harness:
            self.unfollowed.append(Unfollowed(
                "kvzero's own harness runtime (it orders streams with gate kernels no hook sees); "
                "checking resumes when it closes", site))
        self._harness.add(runtime)
        weakref.finalize(runtime, self._harness_gone)

    def harness_closed(self, runtime: Any) -> None:
        if runtime in self._harness:
            self._harness.discard(runtime)
            self._harness_gone()

    def _harness_gone(self) -> None:
        """No harness runtime is left: resume with everything before counted as seen by the host
        (a runtime synchronises when it closes), so nothing it did is later taken for a race."""
        if self._harness:
            return
        self._pending.clear()
        self.hb.host_observes_all()

    def _note_capture(self, site: Site) -> None:
        if not self._capturing_noted:
            self._capturing_noted = True
            self.unfollowed.append(Unfollowed(
                "a CUDA graph (work captured into it runs at replay, which no hook sees)", site))

    def graph_replayed(self, site: Site) -> None:
        self.unfollowed.append(Unfollowed("a CUDA graph replay (the work it runs is not seen op by op)", site))

    # -- force mode --------------------------------------------------------------------------------
    def _release(self, site: Site | None) -> None:
        if self.forcing is None or not self.forcing.holding:
            return
        self._busy = True
        try:
            for pending, delivered in self.forcing.release():
                self._forced_values(pending, delivered)
        finally:
            self._busy = False

    def _forced_values(self, pending: _PendingRead, delivered: np.ndarray) -> None:
        dtype = pending.view.dtype
        text = (f"{pending.stamp.label.access.what} read {shown_values(delivered, dtype)} where "
                f"{shown_values(pending.staged(), dtype)} was staged when it was queued")
        label = pending.stamp.label
        for i, race in enumerate(self.races):
            if race.kind == "host-write-vs-pending-copy" and race.queued is label.access and not race.values:
                self.races[i] = replace(race, values=text)

    # -- results -----------------------------------------------------------------------------------
    def _collect(self) -> None:
        hazards = self.hb.hazards
        while self._hazards_seen < len(hazards):
            self._race(hazards[self._hazards_seen])
            self._hazards_seen += 1
        if len(hazards) > 1024:  # keep the checker's list short; its races are converted already
            del hazards[:]
            self._hazards_seen = 0

    def _race(self, hazard: Hazard) -> None:
        first, second = hazard.first, hazard.second
        if not isinstance(first, _Label) or not isinstance(second, _Label):
            return
        if hazard.kind == "host-write-vs-pending-copy":
            pending = next((p for p in self._pending if p.stamp.label is first), None)
            resource = pending.resource if pending else hazard.resource
            allocated = pending.allocated_at if pending else None
            self.races.append(Race(hazard.kind, resource, allocated, first.access, second.access))
            return
        address = _address_of(hazard.resource)
        reused = address is not None and first.generations.get(address) != second.generations.get(address)
        kind_ = "reuse-without-record-stream" if reused else hazard.kind
        allocated = self._device_sites.get(address) if address is not None else None
        self.races.append(Race(kind_, hazard.resource, allocated, first.access, second.access))

    # -- patches -----------------------------------------------------------------------------------
    def _patch(self, owner: Any, name: str, replacement: Any) -> None:
        self._patches.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)

    def _patch_all(self) -> None:
        event_query, stream_query = torch.cuda.Event.query, torch.cuda.Stream.query
        empty_cache, numpy_ = torch.cuda.empty_cache, torch.Tensor.numpy
        replay = torch.cuda.CUDAGraph.replay
        obs = self

        def host_waits(original: Callable[..., Any], seen: Callable[[tuple, Any], None]) -> Callable[..., Any]:
            """``original``, a call where the host may wait for the GPU: the host's writes are checked and
            force mode's gates opened before it, and ``seen(args, result)`` is told after it."""

            @forwarding
            def call(*args: Any, **kwargs: Any) -> Any:
                if _ACTIVE is obs and not obs.paused:
                    obs._release(obs._boundary())
                result = original(*args, **kwargs)
                if _ACTIVE is obs and not obs.paused:
                    seen(args, result)
                return result

            return call

        def event_done(args: tuple, done: bool) -> None:
            if done:
                obs.event_completed(int(args[0].cuda_event))

        def stream_done(args: tuple, done: bool) -> None:
            if done:
                obs.stream_completed(int(args[0].cuda_stream))

        def emptied(args: tuple, result: Any) -> None:
            obs.cache_emptied()

        @forwarding
        def numpy(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if _ACTIVE is obs and not obs.paused and tensor.device.type == "cpu":
                obs.note_numpy(tensor, caller_site())
            return numpy_(tensor, *args, **kwargs)

        @forwarding
        def replay_graph(graph: Any, *args: Any, **kwargs: Any) -> Any:
            if _ACTIVE is obs and not obs.paused:
                obs.graph_replayed(caller_site())
            return replay(graph, *args, **kwargs)

        self._patch(torch.cuda.Event, "query", host_waits(event_query, event_done))
        self._patch(torch.cuda.Stream, "query", host_waits(stream_query, stream_done))
        self._patch(torch.cuda, "empty_cache", host_waits(empty_cache, emptied))
        self._patch(torch.Tensor, "numpy", numpy)
        self._patch(torch.cuda.CUDAGraph, "replay", replay_graph)
        self._patch_harness()
        try:
            from triton.runtime.jit import JITFunction
        except ImportError:  # pragma: no cover - triton is a dependency
            return
        from racecheck.gate import is_gate_kernel

        run = JITFunction.run

        @forwarding
        def launch(jit: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            if _ACTIVE is obs and not warmup and not obs.paused and not is_gate_kernel(jit) \
                    and threading.get_ident() == obs.thread_id:
                obs.on_triton(jit, args, kwargs, caller_site())
            return run(jit, *args, grid=grid, warmup=warmup, **kwargs)

        self._patch(JITFunction, "run", launch)


    def _patch_harness(self) -> None:
        """Step aside while kvzero's own harness runs a zeroer on CUDA (:meth:`harness_started`)."""
        import zeroer.runtime
        from zeroer.runtime.cuda.common import CudaRuntimeBase

        init, shut_down = CudaRuntimeBase.__init__, CudaRuntimeBase._shut_down
        runtime_code = str(Path(zeroer.runtime.__file__).resolve().parent) + os.sep
        obs = self

        def harness_init(runtime: Any, *args: Any, **kwargs: Any) -> None:
            if _ACTIVE is obs:
                obs.harness_started(runtime, caller_site(beyond=runtime_code))
            try:
                init(runtime, *args, **kwargs)
            except BaseException:
                obs.harness_closed(runtime)
                raise

        def harness_shut_down(runtime: Any) -> None:
            try:
                shut_down(runtime)
            finally:
                obs.harness_closed(runtime)

        self._patch(CudaRuntimeBase, "__init__", harness_init)
        self._patch(CudaRuntimeBase, "_shut_down", harness_shut_down)


_WRITTEN: dict[Any, list[int]] = {}
_ALIASED: dict[Any, list[int | None]] = {}


def _written_positions(func: Any) -> list[int]:
    found = _WRITTEN.get(func)
    if found is None:
        found = _WRITTEN[func] = written_args(func)
    return found


def _aliased(func: Any) -> list[int | None]:
    found = _ALIASED.get(func)
    if found is None:
        found = _ALIASED[func] = aliased_returns(func)
    return found


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among an aten op's arguments (lists of tensors included)."""
    found: list[torch.Tensor] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


def _op_name(func: Any) -> str:
    return str(func).replace("aten.", "").replace(".default", "")


def _address_of(resource: str) -> int | None:
    marker = "device memory at 0x"
    if not resource.startswith(marker):
        return None
    try:
        return int(resource[len(marker):].split()[0], 16)
    except ValueError:
        return None


def _is_pinned(tensor: torch.Tensor) -> bool:
    try:
        return bool(tensor.is_pinned())  # outside the mode's handler this passes the mode as a host op
    except RuntimeError:
        return False


def _raw_stream(device: int | None) -> int:
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    index = torch.cuda.current_device() if device is None else device
    if raw is not None:
        return int(raw(index))
    return int(torch.cuda.current_stream(index).cuda_stream)


# -- torch's GPU trace: registered once per process, forwarded to the active observer ----------------
_ACTIVE: Observer | None = None
_INSTALLED = False


def _forward(name: str) -> Callable[..., None]:
    def callback(*args: Any) -> None:
        observer = _ACTIVE
        if observer is None or observer.paused or threading.get_ident() != observer.thread_id:
            return
        getattr(observer, name)(*args)

    return callback


def _install_trace_callbacks() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    import torch.cuda._gpu_trace as gpu_trace

    torch._C._activate_gpu_trace()
    gpu_trace.register_callback_for_stream_creation(_forward("stream_created"))
    gpu_trace.register_callback_for_event_record(_forward("event_recorded"))
    gpu_trace.register_callback_for_event_wait(_forward("event_waited"))
    gpu_trace.register_callback_for_event_deletion(_forward("event_deleted"))
    gpu_trace.register_callback_for_event_synchronization(_forward("event_synchronized"))
    gpu_trace.register_callback_for_stream_synchronization(_forward("stream_synchronized"))
    gpu_trace.register_callback_for_device_synchronization(_forward("device_synchronized"))
    gpu_trace.register_callback_for_memory_allocation(_forward("memory_allocated"))
    _INSTALLED = True
