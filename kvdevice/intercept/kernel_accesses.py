"""The bytes a Triton kernel read and wrote, resolved to what they fall in and declared as they were.

A kernel that loads its addresses from a table (vLLM's CPU offloading handler: ``src =
tl.load(src_ptrs + i).to(tl.pointer_type(...))``, then loads through ``src`` and stores through
``dst``) touches memory no argument names. Its source cannot say which: the table's values do. On
the simulator the interpreter runs the kernel, so its actual loads and stores are known once it
has run (:class:`Touched`, filled by :class:`~kvdevice.intercept.triton_launch._AddressCheck`). Each
run of addresses is resolved to what it falls in and declared to the happens-before checker with
the launch's stamp, reads and writes apart (``late``: as an indexed op's rows are):

* a KV-cache block, as the caller's own accesses name it (``("block", cache, id)``, through the
  session's :class:`~zeroer.cache.block_map.CacheBlockMap`); a zeroer's session has none and
  declares the blocks of its zero call instead, as before;
* pinned host memory (a host pool slot, a staging buffer): a queued read or write of those bytes,
  as a non-blocking copy's;
* any other simulated device memory, by its bytes.

Until then, the vLLM handler's store kernel was declared as writing the blocks of its call, and
its race-free form was flagged (``triton _swap_blocks_kernel ... (store) writes [block 1]``) while
the kernel only reads the device block.

Example::

    touched = Touched()
    ...                                    # the kernel runs; _AddressCheck calls touched.add(...)
    declare(session, stamp, touched, space, skip_keys=set())
"""

from __future__ import annotations

import inspect
import mmap
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from racecheck.placement import by_memory, place
from racecheck.ranges import Runs


class Touched:
    """The addresses one run of a kernel loaded from and stored to, as merged byte runs."""

    def __init__(self) -> None:
        self._parts: dict[bool, list[tuple[np.ndarray, int]]] = {False: [], True: []}

    def clear(self) -> None:
        """Forget what an earlier run touched (a captured launch replayed)."""
        self._parts = {False: [], True: []}

    def add(self, addresses: np.ndarray, width: int, *, write: bool) -> None:
        """``addresses``: the first byte of each word accessed, ``width`` bytes each."""
        if addresses.size:
            self._parts[write].append((np.unique(addresses.astype(np.int64)), width))

    def runs(self, *, write: bool) -> Runs:
        parts = self._parts[write]
        if not parts:
            return []
        starts = np.concatenate([a for a, _ in parts])
        ends = np.concatenate([a + w for a, w in parts])
        order = np.argsort(starts, kind="stable")
        starts, ends = starts[order], np.maximum.accumulate(ends[order])
        # a new run wherever a word starts past every byte before it
        new = np.ones(starts.shape, bool)
        new[1:] = starts[1:] > ends[:-1]
        firsts = np.flatnonzero(new)
        lasts = np.append(firsts[1:] - 1, starts.size - 1)
        return [(int(starts[f]), int(ends[l])) for f, l in zip(firsts, lasts)]


def declare(session: Any, stamp: Any, touched: Touched, space: Any, *, skip: set, host: Any = None) -> None:
    """Declare what ``touched`` holds for the op ``stamp`` (see the module docstring). ``skip``:
    keys of memory the launch declared already from its arguments (a table it read). ``host``: the
    pinned regions as they were when the launch was queued (the bytes it reads are theirs, though
    the allocator may have handed them to a new tensor since)."""
    hb = session.rt.hb
    memories = [session.memory, host if host is not None else session.host.regions]
    for write in (False, True):
        runs = touched.runs(write=write)
        if not runs:
            continue
        # The address check skipped (and reported) every word outside the memory there was when
        # the kernel ran, so nothing is left unplaced but bytes of a region made since it was queued.
        placed, _ = place(runs, memories, split=True)
        blocks: set[int] = set()
        for part in by_memory(placed):
            if part.kind == "cache":
                # The KV cache, argument or not, by the logical blocks the caller's accesses use; a
                # zeroer's session has no map and declared the blocks of its zero call at launch.
                if session.block_map is not None:
                    blocks.update(session.block_map.of_runs(part.ranges))
                continue
            if part.key in skip:
                continue
            if part.kind == "pinned":  # read or written by the GPU when the kernel runs
                hb.late_host_access(part.key, stamp, write=write, ranges=part.ranges)
                if write:
                    session.host.pending.drop(part.memory, part.ranges)
            hb.device_access(part.key, stamp, write=write, ranges=part.ranges, late=True)
        for block in sorted(blocks):
            hb.device_access(("block", space, block), stamp, write=write, late=True)


class Traced(NamedTuple):
    """What a kernel traced before its launch on a GPU will touch (:func:`trace_through_tables`)."""

    through: Touched  # the bytes it reaches through its tables' values: memory no argument names
    # Each tensor argument that is no table, by name: the bytes of its allocation the kernel reaches
    # through it (real addresses: device memory's, or pinned host memory's). A kernel handed the
    # whole KV cache with the slots to write (vLLM's Triton reshape_and_cache) touches those slots,
    # not the cache. Empty when the trace cannot stand for the kernel (an atomic, a helper's code, a
    # table the kernel writes): its arguments count whole.
    arguments: dict[str, Touched]


def trace_through_tables(fn: Any, grid: tuple, arguments: dict[str, Any], tables: dict[str, np.ndarray]) -> Traced:
    """On a GPU: the bytes a kernel will touch, through its tables and through its other device
    arguments, known before it runs from the values the host staged into the tables (``tables``:
    parameter -> values).

    The kernel runs under Triton's interpreter on the host, every tensor argument a host stand-in:
    a table holds its values and is read as it is. Any other argument (device memory, pinned host
    memory) is address space reserved as large as its allocation and never touched (its values
    steer nothing, which :func:`racecheck.triton_stores.kernel_flow` made sure of; a KV cache of
    many GiB costs no memory): a load or store that lands in it is recorded at the real
    allocation's address and skipped (a load yields ``other``). One that lands outside every
    stand-in went through a table: it is recorded and skipped too, so no byte is read and nothing
    is written."""
    import torch
    from triton.runtime import interpreter as triton_interpreter

    from kvdevice.triton_cpu import interpreted, nested_calls_interpreted
    from racecheck.triton_stores import kernel_flow

    values, spans = [], []
    reserved: list[tuple[str, int, int, int]] = []  # (argument, stand-in's first byte, its end, the real allocation's)
    for name, value in arguments.items():
        if isinstance(value, torch.Tensor) and name in tables:  # a table: its values, as the host staged them
            with torch._C.DisableTorchFunction():
                value = torch.from_numpy(np.ascontiguousarray(tables[name])).to(value.dtype).reshape(value.shape)
                spans.append((value.data_ptr(), value.data_ptr() + max(1, value.numel() * value.element_size())))
        elif isinstance(value, torch.Tensor):  # device memory, or pinned host memory the kernel reads as it is
            value, span = _reserved_stand_in(value)
            if span is not None:
                reserved.append((name, *span))
        values.append(value)
    through = Touched()
    by_argument = {name: Touched() for name, _, _, _ in reserved}
    builder = triton_interpreter.interpreter_builder
    store, load = builder.create_masked_store, builder.create_masked_load

    def kept(ptrs: Any, mask: Any, write: bool) -> Any:
        """The lanes that may touch memory (those inside the tables' stand-ins); every other lane's
        address is recorded, as the argument's it falls in or as reached through a table."""
        addresses = np.asarray(ptrs.data, dtype=np.uint64).reshape(-1)
        shape = np.asarray(ptrs.data).shape
        on = np.asarray(mask.data, dtype=bool).reshape(-1) if mask is not None else np.ones(addresses.shape, bool)
        inside = np.zeros(addresses.shape, bool)
        for lo, hi in spans:
            inside |= (addresses >= np.uint64(lo)) & (addresses < np.uint64(hi))
        width = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
        elsewhere = on & ~inside
        for name, lo, hi, real in reserved:
            hit = elsewhere & (addresses >= np.uint64(lo)) & (addresses < np.uint64(hi))
            if hit.any():
                by_argument[name].add(addresses[hit].astype(np.int64) - lo + real, width, write=write)
                elsewhere &= ~hit
        through.add(addresses[elsewhere], width, write=write)
        return (on & inside).reshape(shape)

    # The interpreter's own methods, their further arguments (a cache policy; a descriptor's load
    # names them) handed on as given.
    def masked_store(ptrs: Any, value: Any, mask: Any, *rest: Any, **options: Any) -> Any:
        return store(ptrs, value, _handle(kept(ptrs, mask, True), mask), *rest, **options)

    def masked_load(ptrs: Any, mask: Any, other: Any, *rest: Any, **options: Any) -> Any:
        return load(ptrs, _handle(kept(ptrs, mask, False), mask), other, *rest, **options)

    # An atomic goes to memory past the two methods above, and what it returns may steer the kernel
    # (a slot taken from a counter): it is recorded as a read and a write of every lane (on a GPU a
    # lane's address may be device memory: never run here, it yields zeros), and a kernel that runs
    # one has its arguments counted whole.
    atomics: list[str] = []
    originals = {name: getattr(builder, name) for name in _ATOMICS if hasattr(builder, name)}

    def atomic(name: str) -> Any:
        signature = inspect.signature(originals[name])  # (rmwOp, ptr, val, mask, ...) or (ptr, cmp, val, ...)

        def run(*args: Any, **kwargs: Any) -> Any:
            atomics.append(name)
            given = signature.bind_partial(*args, **kwargs).arguments
            for write in (False, True):
                kept(given["ptr"], given.get("mask"), write)
            value = given["val"]
            return triton_interpreter.TensorHandle(np.zeros_like(np.asarray(value.data)), value.dtype.scalar)
        return run

    builder.create_masked_store, builder.create_masked_load = masked_store, masked_load
    for name in originals:
        setattr(builder, name, atomic(name))
    try:
        with nested_calls_interpreted():
            interpreted(fn)[grid](*values)
    finally:
        builder.create_masked_store, builder.create_masked_load = store, load
        for name, original in originals.items():
            setattr(builder, name, original)
    # An argument's bytes are taken from the trace only where the reading of the source saw all the
    # kernel does and it writes no table (it would load back what it stored): else its other
    # arguments' values may steer it, and they are not in the trace.
    flow = kernel_flow(fn)
    seen_whole = flow.closed and not (flow.stored & set(tables)) and not atomics
    return Traced(through, by_argument if seen_whole else {})


_ATOMICS = ("create_atomic_rmw", "create_atomic_cas")  # the interpreter's atomics that bypass its loads and stores


# MAP_NORESERVE (Linux's value where Python's mmap does not name it): reserved, never counted as committed
_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


def _reserved_stand_in(tensor: Any) -> tuple[Any, tuple[int, int, int] | None]:
    """A host stand-in for device ``tensor`` at the same place in an allocation as large as its own,
    over address space reserved and never touched; and (its allocation's first byte, end, the real
    allocation's first byte), or None for an empty allocation."""
    import torch

    storage = tensor.untyped_storage()
    nbytes = storage.nbytes()
    if nbytes == 0:
        with torch._C.DisableTorchFunction():
            return torch.empty(tensor.shape, dtype=tensor.dtype), None
    space = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | _NORESERVE)
    with torch._C.DisableTorchFunction():
        held = torch.frombuffer(space, dtype=torch.uint8).untyped_storage()  # keeps the mapping alive
        stand_in = torch.empty(0, dtype=tensor.dtype).set_(held, tensor.storage_offset(), tensor.shape, tensor.stride())
    base = held.data_ptr()
    return stand_in, (base, base + nbytes, storage.data_ptr())


class TableUnresolved(Exception):
    """Tables a kernel goes through whose values cannot be known before it runs (``params`` names
    every one, ``param`` the first; ``deeper``: they are loaded through another table)."""

    def __init__(self, params: list[str], deeper: bool) -> None:
        *rest, last = [repr(p) for p in params]
        self.named = f"arguments {', '.join(rest)} and {last}" if rest else f"argument {last}"
        super().__init__(self.named)
        self.params, self.param, self.deeper = list(params), params[0], deeper


def trace_tables(fn: Any, grid: Any, arguments: dict[str, Any], tables: list[str],
                 values_of: Callable[[Any], Any]) -> Traced:
    """Before a launch on a GPU: what kernel ``fn`` will touch through ``tables`` (its parameters that
    hold addresses or indices) and through its other device arguments, traced on the tables' values (``values_of(tensor)``: what the host put there, or None
    when unknown) by :func:`trace_through_tables`. Raises :class:`TableUnresolved` naming every table
    whose values are unknown (in name order: the first named is not the first made), or all of them
    when a table is loaded through another table."""
    from racecheck.triton_stores import kernel_flow

    deeper = kernel_flow(fn).deeper
    if deeper:
        raise TableUnresolved(sorted(tables), deeper)
    known: dict[str, np.ndarray] = {}
    unknown = []
    for param in sorted(tables):
        values = values_of(arguments[param])
        if values is None:
            unknown.append(param)
        else:
            known[param] = np.asarray(values)
    if unknown:
        raise TableUnresolved(unknown, deeper)
    launch_grid = grid(dict(arguments)) if callable(grid) else grid
    launch_grid = tuple(launch_grid) if isinstance(launch_grid, (tuple, list)) else (launch_grid,)
    return trace_through_tables(fn, launch_grid, dict(arguments), known)


def through_tables_on_cuda(session: Any, name: str, fn: Any, arguments: dict[str, Any], grid: Any,
                           tables: list[str]) -> list[tuple[Any, bool]]:
    """On CUDA, in a fuzzed session: the memory a kernel that loads its addresses from ``tables``
    will touch, as (place, writes) pairs (:meth:`kvdevice.intercept.driver_copies.DriverCopies.place`:
    device memory, the KV cache's bytes, or pinned host memory), from the tables' values as the code
    made them (:mod:`racecheck.device_values`), the kernel traced on them under the
    interpreter (:func:`trace_through_tables`). A table whose values are not known, or a table of
    tables, cannot be followed: a harness error that names it (never a guess)."""
    from kvdevice.intercept.errors import unroutable

    try:
        touched = trace_tables(fn, grid, arguments, tables, session.cuda_ops.values.values).through
    except TableUnresolved as unknown:
        why = ("a table loaded through another table" if unknown.deeper else
               "device memory whose values the code did not make from the host (or from values known so) "
               "while the tool runs, or that a device op wrote since")
        raise unroutable(f"{name}: {unknown.named}",
                         f"{'they are tables' if len(unknown.params) > 1 else 'it is a table'} of addresses the "
                         f"kernel loads and goes through, in {why}, so what the "
                         f"kernel touches cannot be known before it runs",
                         "build the table on the host and copy it to the device (torch.from_numpy(t).to('cuda')) "
                         "while the tool runs, or fuzz on the simulator (--backend sim), which follows the "
                         "kernel's actual loads and stores") from None
    places = []
    for write in (False, True):
        for lo, hi in touched.runs(write=write):
            role = "destination" if write else "source"
            places.append((session.driver.place(lo, hi - lo, f"{name} through a table", role), write))
    return places


def _handle(kept: Any, mask: Any) -> Any:
    """``kept`` (a boolean array) as the interpreter's mask handle."""
    from triton.runtime import interpreter as triton_interpreter

    data = np.asarray(getattr(kept, "data", kept), dtype=bool)
    dtype = mask.dtype if mask is not None else None
    if dtype is None:
        import triton.language as tl

        dtype = tl.int1
    return triton_interpreter.TensorHandle(data, dtype)
