"""Triton launches: one op on the launching thread's stream, reading its tensor arguments and
writing those that reach a ``tl.store``.

``kernel[grid](*args)`` is ``JITFunction.run``, no aten op, so the observer wraps it. A device
tensor argument is read (or written, when the kernel's source stores through it:
:func:`racecheck.triton_stores.kernel_flow`) over the bytes of its view; a pinned host tensor
argument is read by the GPU when the kernel runs (zero-copy), as a non-blocking copy reads it, so
it gets a snapshot and, in force mode, a gate; one the kernel stores into is written as a
device-to-host copy writes it (the host may read it once it has seen the kernel end). A kernel that
goes through raw addresses loaded from a table (vLLM's CPU offloading handler's
``_swap_blocks_kernel``) touches what the table's values, as the program staged them, lead it to,
and a kernel that goes through a table of indices (vLLM's Triton ``reshape_and_cache``, handed the
whole KV cache and the slot mapping) touches the slots they name, not the whole cache: traced
before the launch, each device argument other than the tables is declared by the bytes the trace
reached in it. A table the host never staged is one line and the run partial
(:func:`_through_tables`). The gate kernel of force mode and of kvzero's harness is the sanitizer's
own and never checked.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from triton.runtime.jit import JITFunction

from racecheck.gate import is_gate_kernel
from racecheck.custom_ops import host_values
from racecheck.placement import place
from racecheck.triton_stores import kernel_flow
from sanitizer.gpu.custom import declare_placed
from sanitizer.sites import caller_site
from kvdevice.intercept.kernel_accesses import TableUnresolved, trace_tables
from kvdevice.intercept.sim_tensor import SimCudaTensor
from sanitizer.races import Unfollowed


def patch(obs: Any, patch_fn: Callable[..., None], wrap: Callable[..., Any]) -> None:
    """Wrap ``JITFunction.run`` (:func:`sanitizer.gpu.patches.install` gives ``patch_fn`` and ``wrap``)."""
    def launching(jit: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        if not warmup and not is_gate_kernel(jit):
            on_launch(obs, jit, args, kwargs, grid)

    patch_fn(JITFunction, "run", wrap(launching))


def on_launch(obs: Any, jit: Any, args: tuple, kwargs: dict, grid: Any = None) -> None:
    """A Triton launch about to be issued by the calling thread (called under the observer's lock)."""
    names = list(getattr(jit, "arg_names", []))
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    tensors = [(n, v) for n, v in bound.items() if isinstance(v, torch.Tensor)]
    if any(isinstance(v, SimCudaTensor) for _, v in tensors):
        return  # a launch on kvzero's simulator
    device = obs.device
    on_device = [(n, v) for n, v in tensors if device.is_device(v)]
    pinned = [(obs.region_of(v), v, n) for n, v in tensors if not device.is_device(v)]
    if not on_device and not any(region is not None for region, _, _ in pinned):
        return
    flow = kernel_flow(jit.fn)
    stored = flow.stored
    pinned = [(region, v, n in stored) for region, v, n in pinned if region is not None]
    site = caller_site()
    obs.boundary(site)
    what = f"Triton kernel {getattr(jit, '__name__', 'kernel')}"
    tables = [n for n in flow.tables if isinstance(bound.get(n), torch.Tensor)]
    record = obs.graphs.capturing()
    if record is not None:
        if tables:  # a replay's tables may hold other values: not followed
            obs.unfollowed.append(Unfollowed(f"{what}'s argument {tables[0]!r} (an address table) inside a CUDA "
                                             f"graph capture", site))
        record.triton(what, site, [(v, n in stored) for n, v in on_device], pinned)
        return
    forcing = obs.forcing
    if forcing is not None and forcing.first_launch(jit):
        obs.release_forced(site)  # loading a new kernel module waits for the GPU to drain
    index = device.device_index(on_device[0][1] if on_device else None)
    held = obs.hold(index) if pinned else None
    stamp = obs.enqueue(what, device.current_stream(index), site)
    traced: dict[str, Any] = {}
    if tables:
        # The kernel loads its addresses as the tables hold them when it starts: traced before its
        # own writes are declared, which make a written argument's values unknown (where the source
        # cannot be read, every argument counts as written: the tables with them).
        traced = _through_tables(obs, jit, args, kwargs, grid, tables, stamp, site, what)
    for name, tensor in on_device:
        reached = traced.get(name)
        if reached is None:  # no trace: the whole argument, written if the source stores through it
            obs.device_access(tensor, stamp, write=name in stored)
            continue
        address = tensor.untyped_storage().data_ptr()  # traced: the bytes its loads and stores reach
        for write in (False, True):
            runs = reached.runs(write=write)
            if runs:
                obs.device_access_at(address, runs, stamp, write=write)
    for region, tensor, writes in pinned:
        if writes:  # a kernel storing into pinned memory: the host sees it once it saw the kernel end
            obs.queued_write(region, tensor, stamp, held)
        else:
            obs.queued_read(region, tensor, stamp, held)
        obs.raw_pinned_access(region, stamp, region.runs(tensor), write=writes)  # through its pointer
    obs.collect()


def _through_tables(obs: Any, jit: Any, args: tuple, kwargs: dict, grid: Any, tables: list[str], stamp: Any,
                    site: Any, what: str) -> dict[str, Any]:
    """What a kernel that loads its addresses or indices from tables (vLLM's ``_swap_blocks_kernel``,
    its Triton ``reshape_and_cache`` with a slot mapping) touches: the tables' values as the program
    staged them from the host (:mod:`sanitizer.gpu.indices`), the kernel traced under the
    interpreter on them (:func:`kvdevice.intercept.kernel_accesses.trace_tables`). What it reaches
    through the tables' values is declared here, each run placed in the pinned region or device
    allocation it falls in; what it reaches of each other device argument is returned, by name
    (a :class:`~kvdevice.intercept.kernel_accesses.Touched`), for the caller to declare instead of
    the whole argument. A table whose values the host never staged, or a run no allocation holds,
    is one line: the run is partial, never a silent pass (and every argument is then declared whole)."""
    device = obs.device
    signature = inspect.signature(jit.fn)
    bound = signature.bind(*args, **{k: v for k, v in kwargs.items() if k in signature.parameters})
    bound.apply_defaults()
    arguments = dict(bound.arguments)

    def values_of(tensor: Any) -> Any:
        return obs.indices.values(tensor) if device.is_device(tensor) else host_values(tensor)

    try:
        traced = trace_tables(jit.fn, grid, arguments, tables, values_of)
    except TableUnresolved as unknown:
        why = ("a table loaded through another table" if unknown.deeper else
               "device memory whose values the program did not stage from the host")
        tables_are = "address tables" if len(unknown.params) > 1 else "an address table"
        obs.unfollowed.append(Unfollowed(f"{what}'s {unknown.named} ({tables_are} the kernel goes "
                                         f"through, in {why})", site))
        return {}
    except Exception as error:  # noqa: BLE001 - the interpreter's limit (the GPU runs the kernel), never the program's
        cause = error.__cause__ or error
        obs.unfollowed.append(Unfollowed(f"{what} (Triton's interpreter could not trace it on its tables' values: "
                                         f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}; "
                                         f"what it touches through them is not checked)", site))
        return {}
    for write in (False, True):
        # split: words of allocations laid side by side merge into runs that cross from one into the next
        placed, unplaced = place(traced.through.runs(write=write), [obs.pinned.regions, device], split=True)
        for lo, hi in unplaced:
            obs.unfollowed.append(Unfollowed(
                f"{what}: the {hi - lo} bytes at 0x{lo:x} it {'writes' if write else 'reads'} through a table "
                f"(no allocation or pinned region the sanitizer knows holds them)", site))
        declare_placed(obs, placed, stamp, write=write)
    return traced.arguments


__all__ = ["on_launch", "patch"]
