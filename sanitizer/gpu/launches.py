"""Triton launches: one op on the launching thread's stream, reading its tensor arguments and
writing those that reach a ``tl.store``.

``kernel[grid](*args)`` is ``JITFunction.run``, no aten op, so the observer wraps it. A device
tensor argument is read (or written, when the kernel's source stores through it:
:func:`racecheck.triton_stores.stored_params`) over the bytes of its view; a pinned host tensor
argument is read by the GPU when the kernel runs (zero-copy), as a non-blocking copy reads it, so
it gets a snapshot and, in force mode, a gate; one the kernel stores into is written as a
device-to-host copy writes it (the host may read it once it has seen the kernel end). Kernels that
write through raw addresses (a table of ``data_ptr()`` values, as vLLM's zeroer does) write memory
no argument names: those writes are not seen (docs/sanitizer.md). The gate kernel of force mode and of kvzero's harness is the
sanitizer's own and never checked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from racecheck.gate import is_gate_kernel
from racecheck.triton_stores import stored_params
from sanitizer.sites import caller_site
from zeroer.intercept.sim_tensor import SimCudaTensor
from zeroer.origin import forwarding


def patch(obs: Any, patch_fn: Callable[..., None], active: Callable[[], bool]) -> None:
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:  # pragma: no cover - triton is a dependency
        return

    def wrap(run: Any) -> Any:
        @forwarding
        def launch(jit: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            if not warmup and active() and not is_gate_kernel(jit):
                with obs.lock:
                    on_launch(obs, jit, args, kwargs)
            return run(jit, *args, grid=grid, warmup=warmup, **kwargs)

        return launch

    patch_fn(JITFunction, "run", wrap)


def on_launch(obs: Any, jit: Any, args: tuple, kwargs: dict) -> None:
    """A Triton launch about to be issued by the calling thread (called under the observer's lock)."""
    names = list(getattr(jit, "arg_names", []))
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    tensors = [(n, v) for n, v in bound.items() if isinstance(v, torch.Tensor)]
    if any(isinstance(v, SimCudaTensor) for _, v in tensors):
        return  # a launch on kvzero's simulator
    device = obs.device
    on_device = [(n, v) for n, v in tensors if device.is_device(v)]
    pinned = [(obs.pinned_region(v), v, n) for n, v in tensors if not device.is_device(v)]
    if not on_device and not any(region is not None for region, _, _ in pinned):
        return
    stored = stored_params(jit.fn)
    pinned = [(region, v, n in stored) for region, v, n in pinned if region is not None]
    site = caller_site()
    obs.boundary(site)
    what = f"Triton kernel {getattr(jit, '__name__', 'kernel')}"
    record = obs.graphs.capturing()
    if record is not None:
        record.triton(what, site, [(v, n in stored) for n, v in on_device], pinned)
        return
    forcing = obs.forcing
    if forcing is not None and forcing.first_launch(jit):
        obs.release_forced(site)  # loading a new kernel module waits for the GPU to drain
    index = device.device_index(on_device[0][1] if on_device else None)
    held = obs.hold(index) if pinned else None
    stamp = obs.enqueue(what, device.current_stream(index), site)
    for name, tensor in on_device:
        obs.device_access(tensor, stamp, write=name in stored)
    for region, tensor, writes in pinned:
        if writes:  # a kernel storing into pinned memory: the host sees it once it saw the kernel end
            obs.queued_write(region, tensor, stamp, held)
        else:
            obs.queued_read(region, tensor, stamp, held)
    obs.collect()


__all__ = ["on_launch", "patch"]
