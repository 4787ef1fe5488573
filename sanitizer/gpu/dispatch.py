"""Every aten op, seen on its way to torch: what it reads and writes, on which stream, from which thread.

A ``TorchDispatchMode`` is entered in every thread the program runs torch in (modes are per thread;
:meth:`sanitizer.gpu.observer.Observer.thread_setup`). For each op:

* **device work** is stamped on the stream torch is about to use, with the bytes it reads and
  writes (the schema's ``(a!)`` arguments and fresh outputs are writes; an indexed op touches only
  the rows its index tensor names, :mod:`sanitizer.gpu.indices`); an op on small integer tensors
  whose values are known is evaluated on the host too, so tables made on the device stay known
  (:mod:`racecheck.device_values`);
* **copies** take CUDA's meaning (:func:`racecheck.ops.copy_kind`): a non-blocking copy from
  pinned memory reads it when its stream gets there (a snapshot of the bytes is kept); a
  non-blocking copy to pinned memory writes it then (a pending write the host may not read or
  write before it has seen the copy complete); a blocking one makes the host wait;
* **host ops** on pinned memory (a torch op on the CPU tensor, ``.item()``) are host reads and
  writes, checked against the copies pending on those bytes; pinned allocations are remembered with
  the line that made them;
* ops captured into a CUDA graph are recorded for its replays (:mod:`sanitizer.gpu.graphs`).

The mode opts out of torch's compiler hook (``_should_skip_dynamo``): nothing here needs
``torch._dynamo``, whose import costs seconds and whose per-call guard costs microseconds per op;
once the program itself imports it (``torch.compile``), the handler is wrapped as torch would wrap
it (:class:`sanitizer.dynamo_guard.SanitizerMode`), so dynamo never traces the sanitizer's frames.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from racecheck.devices import names_cuda
from racecheck.ops import decomposed, op_info, op_name
from sanitizer.gpu import custom
from racecheck.lazy_dynamo import guard_once_dynamo_loaded
from sanitizer.dynamo_guard import SanitizerMode
from sanitizer.gpu.copies import copy
from sanitizer.host_ops import tensors_of, written_tensors
from sanitizer.sites import Site, caller_site
from kvdevice.intercept.sim_tensor import SimCudaTensor
from kvdevice.origin import forwarding

aten = torch.ops.aten
_PIN = {getattr(packet, "default") for packet in (getattr(aten, "_pin_memory", None), getattr(aten, "pin_memory", None))
        if packet is not None and hasattr(packet, "default")}
_SCALAR = aten._local_scalar_dense.default
_RECORD_STREAM = aten.record_stream.default


class Ops(SanitizerMode):
    """The mode (see the module docstring); one instance per thread."""

    def __init__(self, observer: Any) -> None:
        super().__init__()
        self.handler = Handler(observer, self)

    @forwarding  # the program's own call, handed on: what torch raises under it is the program's
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # SanitizerMode's handler with on_dispatch folded in: one Python frame less on every op
        guard_once_dynamo_loaded(Ops)
        handler = self.handler
        if handler.obs.paused:
            return func(*args, **(kwargs or {}))
        return handler.on_op(func, args, kwargs or {})


def enter(observer: Any) -> Callable[[], None]:
    """Enter a fresh mode in the calling thread; the function that leaves it again."""
    mode = Ops(observer)
    mode.__enter__()
    return lambda: mode.__exit__(None, None, None)


class Handler:
    """What one op means to the observer (see the module docstring)."""

    def __init__(self, observer: Any, mode: Any) -> None:
        self.obs = observer
        self.device = observer.device
        self.mode = mode  # the thread's Ops, entered again for a composite op's parts

    @forwarding
    def on_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        info = op_info(func)
        if info.custom:  # an extension's op: its effect model says what it touches (sanitizer.gpu.custom)
            return custom.on_op(self, func, args, kwargs)
        if info.composite:  # under torch.inference_mode(): x.to(...) whole
            result = decomposed(self.mode, func, args, kwargs)
            if result is not NotImplemented:
                return result
        device = self.device
        tensors = tensors_of(args, kwargs)
        on_device = []  # one pass: this runs for every op of the program
        for tensor in tensors:
            if isinstance(tensor, SimCudaTensor):
                return func(*args, **kwargs)  # kvzero's simulator at work (its "cuda" is CPU memory)
            if device.is_device(tensor):
                on_device.append(tensor)
        if not on_device:
            target = kwargs.get("device") if kwargs else None
            if not names_cuda(target):
                return self.host_op(func, args, kwargs, tensors)
        what = info.kind
        if what == "view":
            return func(*args, **kwargs)
        obs = self.obs
        if what == "alloc":  # fresh memory: whatever was known at its address is gone
            result = func(*args, **kwargs)
            if isinstance(result, torch.Tensor) and device.is_device(result):
                with obs.lock:
                    obs.values.written(result.untyped_storage().data_ptr())
            return result
        site = caller_site()
        index = device.device_index(on_device[0] if on_device else None)
        with obs.lock:
            # A copy compares the snapshots every time (one it queues must not be taken for the reader
            # of a host write made before it), and so does an op the host waits for (after it, the host
            # has seen the copies complete): a quick boundary may leave a window open.
            obs.boundary(site, quick=what != "copy" and what != "to_copy" and what != "blocking" and func is not _SCALAR)
            record = obs.graphs.capturing()
            if record is not None:
                return record.op(self, func, args, kwargs, what, on_device, site)
            if func is _RECORD_STREAM:
                obs.stream_recorded(args[0])
                return func(*args, **kwargs)
            if what == "copy" or what == "to_copy":
                return copy(self, func, args, kwargs, what, site, index)
            blocking = what == "blocking" or func is _SCALAR
            if blocking:
                obs.release_forced(site)  # the host waits for the stream here: forced holds open first
            stream = device.current_stream(index)
            stamp = obs.enqueue(info.name, stream, site)
            written = _written(info, func, args, kwargs)
            # an op on small integers is evaluated on the host, on the values it reads (racecheck.device_values)
            pending = obs.values.prepare(func, args, kwargs, on_device)
            if info.indexed is None and info.index_list is None:  # the common case: whole tensors, no rows
                for tensor in on_device:
                    obs.device_access(tensor, stamp, write=_is_in(tensor, written))
            else:
                obs.indices.declare(func, args, kwargs, stamp, on_device, written)
        result = func(*args, **kwargs)
        with obs.lock:
            if info.fresh != ():  # an in-place op's returns are its arguments: nothing new to declare
                for out in fresh_outputs(func, result, device, on_device):
                    obs.device_access(out, stamp, write=True)
            obs.values.commit(pending, result)
            if blocking:
                obs.observes_stream(stream)
            obs.collect()
        return result

    # -- host ops -----------------------------------------------------------------------------------
    @forwarding
    def host_op(self, func: Any, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> Any:
        obs = self.obs
        if kwargs.get("pin_memory") or func in _PIN:
            site = caller_site()
            with obs.lock:
                obs.release_forced(site)  # pinned allocation may wait for the GPU (racecheck.gate)
            result = func(*args, **kwargs)
            if isinstance(result, torch.Tensor) and result.device.type == "cpu":
                with obs.lock:
                    obs.note_pinned(result, site, op_name(func))
            return result
        if not obs.pinned.regions or not tensors:
            return func(*args, **kwargs)
        return obs.host_op(func, args, kwargs, tensors)


# -- what an op touches --------------------------------------------------------------------------------

def _written(info: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """The tensors ``func`` writes in place; for the most frequent kind, a method that writes its own
    tensor (``x.mul_(2)``: position 0, given), without building its arguments by position."""
    written = info.written
    if not written:
        return ()
    if written == (0,) and args and isinstance(args[0], torch.Tensor):
        return (args[0],)
    return written_tensors(func, args, kwargs)


def _is_in(tensor: torch.Tensor, written: Any) -> bool:
    """Whether ``tensor`` is one of ``written`` (by identity: equal tensors are not the same argument)."""
    for other in written:
        if other is tensor:
            return True
    return False


def fresh_outputs(func: Any, result: Any, device: Any, on_device: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The device tensors ``func`` returned that alias none of its arguments (new memory it wrote)."""
    aliased = op_info(func).aliased
    outputs = result if isinstance(result, (tuple, list)) else (result,)
    fresh = [o for i, o in enumerate(outputs) if isinstance(o, torch.Tensor)
             and (i >= len(aliased) or aliased[i] is None)]
    if on_device:
        for out in fresh:
            device.adopt(out)
    return [o for o in fresh if device.is_device(o)]


__all__ = ["Handler", "Ops", "Site", "enter", "fresh_outputs", "op_name", "written_tensors"]
