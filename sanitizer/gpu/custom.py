"""Custom ops on a GPU: what an extension's op reads and writes, from its effect model.

An op of a C++ extension (``torch.ops._C_cache_ops.swap_blocks``, ``torch.ops.sgl_kernel.
transfer_kv_all_layer``) reaches the dispatch mode like any aten op, but its schema need not say
what it touches; a pybind function (``lmcache.c_ops.multi_layer_block_kv_transfer``) reaches no
mode at all, so while the observer runs it is wrapped (:func:`racecheck.custom_ops.extension_modules`),
and so is an op no extension defines here, whose stand-in routes its calls to :func:`router` (the
program's own definition of it, whenever it comes, reaches the dispatch mode as the extension's would).
Either way the op's model (:mod:`racecheck.custom_ops`) says the byte runs it reads and writes,
each resolved to the device allocation or pinned region it falls in and stamped on the current
stream. The values a model needs (indices, tables of layer addresses) are read where the host
holds them, or where the program staged them to the device (:mod:`sanitizer.gpu.indices`); where
they are not known, a note says the op's accesses are not checked (a miss, never a false race). A
run in plain (pageable) host memory is the host's, at the call, as CUDA stages such a copy before
the call returns; a run the observer can place nowhere is one note. Where the program has no
extension, the model's reference makes the op's copies (:mod:`racecheck.raw_copies`), on the device
where the bytes are there, on the current stream.

A custom op with no model is one line (the run is partial): kvz-sanitize cannot say what it touches.
"""

from __future__ import annotations

from typing import Any

import torch

from racecheck.custom_ops import (EffectModel, ValueUnknown, host_values, known_values, missing_model, model_for, op_name,
                                  route, unrouted)
from racecheck.placement import Extents, Placed, place
from sanitizer.sites import Site, caller_site
from kvdevice.intercept.sim_tensor import SimCudaTensor
from kvdevice.origin import forwarding
from sanitizer.races import Unfollowed


@forwarding
def on_op(handler: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """A ``torch.ops`` op outside torch's namespaces, seen by the dispatch mode."""
    if any(isinstance(v, SimCudaTensor) for v in (*args, *kwargs.values())):
        return func(*args, **kwargs)  # kvzero's simulator at work
    obs = handler.obs
    model = model_for(func)
    site = caller_site()
    if model is None:
        name = op_name(func)
        with obs.lock:
            obs.unfollowed.append(Unfollowed(f"custom op {name} ({missing_model(name)})", site))
        return func(*args, **kwargs)
    return call(obs, model, model.bind(args, kwargs, func), lambda: func(*args, **kwargs), site)


def router(obs: Any) -> Any:
    """The observer's router for modelled calls no mode sees (pybind functions)."""

    def route(model: EffectModel, args: tuple, kwargs: dict, real: Any) -> Any:
        if obs.paused:
            return _run(model, args, kwargs, real, obs)
        return call(obs, model, model.bind(args, kwargs), lambda: _run(model, args, kwargs, real, obs), caller_site())

    return route


@forwarding  # the program's own function handed on: what it raises is the program's (kvdevice.origin)
def _run(model: EffectModel, args: tuple, kwargs: dict, real: Any, obs: Any = None) -> Any:
    if real is not None:
        return real(*args, **kwargs)
    # No extension: the model's reference makes the op's copies, on the device where the bytes are
    # there, reading device-held indices as the program staged them (sanitizer.gpu.indices).
    known = obs.indices.values if obs is not None and getattr(obs, "indices", None) is not None else (lambda _: None)
    with unrouted(), known_values(known):
        return route(model, args, kwargs)


def call(obs: Any, model: EffectModel, given: list[Any], run: Any, site: Site) -> Any:
    """Stamp the op on the current stream with what its model says it touches, then run it."""
    device = obs.device
    tensors = [v for v in given if isinstance(v, torch.Tensor)]
    on_device = [t for t in tensors if device.is_device(t)]
    with obs.lock:
        obs.boundary(site)
        index = device.device_index(on_device[0] if on_device else None)
        stamp = obs.enqueue(model.short_name, device.current_stream(index), site)
        declare(obs, model, given, tensors, stamp, site)
    result = run()
    with obs.lock:
        obs.collect()
    return result


def declare(obs: Any, model: EffectModel, given: list[Any], tensors: list[torch.Tensor], stamp: Any, site: Site) -> None:
    device = obs.device

    def values(tensor: torch.Tensor) -> list[int]:
        if not device.is_device(tensor):
            return host_values(tensor)
        known = obs.indices.values(tensor)
        if known is None:
            raise ValueUnknown("device memory the program did not stage")
        return known

    try:
        fx = model.declare(given, values)
    except ValueUnknown:
        obs.notes.append(f"kvz-sanitize could not tell what {model.name} at {site} touches (its effect model "
                         f"needs values held in device memory that the host never staged); its accesses are not checked")
        return
    # An argument in plain host memory (a mapping, a table) is read by the host at the call.
    arguments = Extents.of_storages(tensors, lambda t: "device" if device.is_device(t) else
                                    "host" if obs.region_of(t) is None else None)
    memories = [arguments, obs.pinned.regions, device, _Pageable(device)]
    for runs, write in ((fx.reads, False), (fx.writes, True)):
        # split: the op's pointers may reach objects the allocator laid side by side, whose runs merge
        # into one no single allocation holds (two pin_memory=True objects of LMCache's gather on an H100)
        placed, unplaced = place(runs, memories, split=True)
        for lo, hi in unplaced:
            obs.notes.append(f"kvz-sanitize could not place the {hi - lo} bytes at 0x{lo:x} that {model.name} at "
                             f"{site} {'writes' if write else 'reads'} (no allocation it knows holds them); "
                             f"that access is not checked")
        declare_placed(obs, placed, stamp, write=write)


def declare_placed(obs: Any, placed: list[Placed], stamp: Any, *, write: bool) -> None:
    """``stamp`` reads or writes each run of ``placed`` (device or pinned memory; the host's are its own)."""
    hb = obs.hb
    for part in placed:
        if part.kind == "pinned":
            (hb.copy_writes_host if write else hb.copy_reads_host)(part.key, stamp, part.ranges)
            hb.device_access(part.key, stamp, write=write, ranges=part.ranges)
            obs.raw_pinned_access(part.memory, stamp, part.ranges, write=write)
        elif part.kind == "device":
            obs.device_access_at(part.memory, part.ranges, stamp, write=write)


class _Pageable:
    """Plain host memory, as the driver says: an op's copy from or to it is the host's, at the call
    (CUDA stages such a copy before the call returns)."""

    def __init__(self, device: Any) -> None:
        self.is_pageable = device.is_pageable

    def holding(self, start: int, end: int) -> Placed | None:
        return Placed(None, None, "host", [(start, end)]) if self.is_pageable(start, end - start) else None


__all__ = ["call", "on_op", "router"]
