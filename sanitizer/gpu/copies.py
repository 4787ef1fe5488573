"""Copies between host and device, as CUDA runs them: who may touch which bytes until when.

``copy_(dst, src, non_blocking)`` and ``_to_copy(src, device=..., non_blocking=...)`` mean, by the
memories involved (:func:`racecheck.ops.copy_kind`):

* host to device, non-blocking, from pinned memory: queued; it reads the host bytes when its
  stream gets there, so the host may not rewrite them before it has seen the copy complete (a
  snapshot of them is kept, :mod:`racecheck.pinned`); force mode holds it behind a gate;
* device to host, non-blocking, into pinned memory (``.to("cpu", non_blocking=True)`` pins its
  result): queued; it writes the host bytes when its stream gets there, so the host may not read or
  write them before it has seen the copy complete; force mode holds it too;
* anything else with the host on one side: the host waits (a blocking copy synchronises the
  stream; CUDA stages pageable bytes before returning) and has seen the stream after; so does a
  non-blocking copy whose host side torch passes through a pageable temporary (another layout or
  dtype than the device side: :func:`racecheck.ops.host_temporary`);
* device to device: queued, like any kernel.

The values a copy into device memory delivers are shadowed for small integer tensors, from pinned
or pageable memory or from known device values (:mod:`racecheck.device_values`), so that a later
``index_select`` over them knows its rows (:mod:`sanitizer.gpu.indices`) and a kernel loading its
pointers from them what it touches.
"""

from __future__ import annotations

from typing import Any

import torch

from racecheck.ops import host_temporary, op_name
from sanitizer.sites import Site


def copy(handler: Any, func: Any, args: tuple, kwargs: dict, what: str, site: Site, index: int) -> Any:
    """Run and record ``copy_`` or ``_to_copy`` (called under the observer's lock)."""
    obs, device = handler.obs, handler.device
    if what == "copy":
        dst, src = args[0], args[1]
        non_blocking = bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False))
        to_device = device.is_device(dst)
    else:
        dst, src = None, args[0]
        non_blocking = bool(kwargs.get("non_blocking", False))
        target = kwargs.get("device")
        to_device = device.is_device(src) if target is None else torch.device(target).type == "cuda"
    from_device = device.is_device(src)
    h2d, d2h = not from_device and to_device, from_device and not to_device
    region = obs.region_of(src) if h2d else (obs.region_of(dst) if d2h and dst is not None else None)
    # torch passes a host side of another layout or dtype through a pageable temporary: staged, or synchronous
    temporary = non_blocking and (h2d or d2h) and host_temporary(dst, src, to_device=h2d)
    reads_pinned = h2d and non_blocking and region is not None and not temporary
    writes_pinned = d2h and non_blocking and (dst is None or region is not None) and not temporary
    host_waits = (h2d and not non_blocking) or (d2h and not writes_pinned)
    how = ("non-blocking H2D copy" if reads_pinned else "H2D copy") if h2d else \
          ("non-blocking D2H copy" if writes_pinned else "D2H copy") if d2h else "D2D copy"
    if host_waits:
        obs.release_forced(site)
    if writes_pinned and dst is None and obs.forcing is not None:
        # torch's _to_copy allocates its pinned result inside the op, after a gate would be in place,
        # and a pinned allocation may wait for the GPU: the gate would hold the host too. The same
        # copy in two steps instead: the pinned result first, then the held copy into it.
        with torch._C.DisableTorchFunction():
            dst = torch.empty_like(src, dtype=kwargs.get("dtype") or src.dtype, device="cpu", pin_memory=True,
                                   memory_format=kwargs.get("memory_format") or torch.preserve_format)
        region = obs.note_pinned(dst, site, "the pinned result of .to('cpu', non_blocking=True)")
        func, args, kwargs = torch.ops.aten.copy_.default, (dst, src, True), {}
    held = obs.hold(index) if reads_pinned or writes_pinned else None
    stream = device.current_stream(index)
    stamp = obs.enqueue(f"{op_name(func)} ({how})", stream, site)
    if from_device:
        obs.device_access(src, stamp, write=False)
    # the values it delivers into device memory, from the host's bytes now or known device values
    pending = obs.values.prepare(func, args, kwargs, [t for t in (dst, src) if t is not None and device.is_device(t)]) \
        if to_device else None
    result = func(*args, **kwargs)
    target_tensor = dst if dst is not None else result
    if isinstance(target_tensor, torch.Tensor) and device.is_device(target_tensor):
        obs.device_access(target_tensor, stamp, write=True)
        obs.values.commit(pending, result)
    if reads_pinned:
        obs.queued_read(region, src, stamp, held)
        obs.torch_copied_pinned(region, stamp)
    if writes_pinned and isinstance(target_tensor, torch.Tensor):
        if region is None:
            region = obs.note_pinned(target_tensor, site, f"the pinned result of .to('cpu', non_blocking=True)")
        obs.queued_write(region, target_tensor, stamp, held)
        obs.torch_copied_pinned(region, stamp)
    if host_waits:
        obs.observes_stream(stream)
    obs.collect()
    return result
