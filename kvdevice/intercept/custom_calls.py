"""Custom ops under interception: a modelled op (:mod:`racecheck.custom_ops`) as one queued op.

The op's model says what it reads and writes, as byte runs; each run is resolved to the memory it
falls in and declared to the happens-before checker on the current stream:

* on the simulator, a block of simulated device memory (by its runs), the KV cache (an
  offloader's session maps its bytes to logical blocks; a zeroer's cache writes are the blocks of
  its call), or a pinned host buffer (a queued read or write of those bytes, as a copy's);
* on CUDA, the storage of one of the op's tensor arguments, the KV cache, or a pinned buffer.

Where the model needs values the device holds (SGLang's index tensors, its tables of layer
addresses), the simulator evaluates it when the stream reaches the op, once they are there, and
declares its accesses then (the checker's verdict does not depend on the order of declarations);
on CUDA the fuzzer reads no device memory at a call: it knows the values the code made from the
host or from values known so (:mod:`racecheck.device_values`), and any other is a harness error
naming the op.
The simulator runs the model's reference implementation on the CPU memory behind its tensors; on
CUDA, where the program has no extension, the reference makes the op's copies on the device, queued
as one op of the runtime (behind its gate in the controlled mode), from the same values.

A run the model declares outside any memory the tool knows is an error naming the op and the
address, never dropped. A custom op with no model is :func:`unmodelled`'s error.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

from racecheck.custom_ops import EffectModel, ValueUnknown, host_values, known_values, missing_model, op_name
from racecheck.hb import OpStamp
from racecheck.placement import Extents, Placed, by_memory, place
from racecheck.ranges import merge
from kvdevice.intercept.errors import InterceptError, forward, unroutable
from kvdevice.intercept.cache_access import CacheAccess

MODEL_FIX = "or run the engine where its extension is installed: on {gpu}"  # errors.GPU: each tool's option


def unmodelled(name: str) -> InterceptError:
    """The harness error for custom op ``name`` with no effect model."""
    return InterceptError(f"custom op {name}: {missing_model(name)}")


class _Resolved:
    """A model's runs, placed (:func:`racecheck.placement.place`): device and pinned memory by key,
    the KV cache's bytes as runs (and, on the simulator, the blocks of cache memory they fall in)."""

    def __init__(self, reads: list[Placed], writes: list[Placed]) -> None:
        self.reads = by_memory(reads, ("device",)) + by_memory(reads, ("pinned",))
        self.writes = by_memory(writes, ("device",)) + by_memory(writes, ("pinned",))
        self.cache_read = merge([r for p in reads if p.kind == "cache" for r in p.ranges])
        self.cache_written = merge([r for p in writes if p.kind == "cache" for r in p.ranges])
        self.cache_blocks = {p.key: p.memory for p in reads + writes if p.kind == "cache"}  # the simulator's

    def by_key(self, kind: str) -> list[tuple[Any, Any, Any]]:
        """(key, runs read, runs written) of each memory of ``kind``, in the order first met."""
        read = {p.key: p.ranges for p in self.reads if p.kind == kind}
        written = {p.key: p.ranges for p in self.writes if p.kind == kind}
        return [(key, read.get(key), written.get(key)) for key in {**read, **written}]


class _CacheBytes:
    """The KV cache's buffers, by the block map (:class:`racecheck.placement.Memories`)."""

    def __init__(self, block_map: Any) -> None:
        self.contains = block_map.contains

    def holding(self, start: int, end: int) -> Placed | None:
        return Placed(None, "cache", "cache", [(start, end)]) if self.contains(start) else None


class CustomCalls:
    """Modelled custom ops of one session (see the module docstring)."""

    def __init__(self, session: Any) -> None:
        self.session = session

    # -- the simulator -------------------------------------------------------------------------------
    def sim(self, model: EffectModel, args: tuple, kwargs: dict, func: Any = None) -> None:
        """Queue ``model``'s op on the current stream: its accesses declared, its reference run when
        the stream gets there."""
        from kvdevice.intercept.sim_tensor import SimCudaTensor, uncloak

        session = self.session
        given = model.bind(tree_map(uncloak, args), kwargs, func)
        on_device: set[int] = set()

        def inner(value: Any) -> Any:
            if isinstance(value, SimCudaTensor):
                on_device.add(id(value._inner))
                return value._inner
            return value

        inner_args = tree_map(inner, given)
        name = model.short_name
        runs = model.reference
        if runs is None and _runs_on_the_host(func):
            runs = func  # the program's own op, defined with a CPU (or any-device) kernel: it runs as itself
        if runs is None:
            raise unroutable(f"{model.name} on the simulator", "its effect model has no reference implementation",
                             "give effect_model(...) a reference= (a CPU implementation) " + MODEL_FIX)

        def now(tensor: torch.Tensor) -> list[int]:
            if id(tensor) in on_device:
                raise ValueUnknown("device memory, written by work still queued")
            return host_values(tensor)

        # A host tensor argument (a block mapping, a table of addresses) is read by the host at the
        # call; only pinned memory is the device's to read later.
        host_args = _host_arguments(given, session.host)
        try:
            found = self._resolve(model, model.declare(inner_args, now), [host_args, session.memory, session.host.regions])
        except ValueUnknown:
            found = None
        ids = session.ids
        regions = None
        if found is None:  # declared as it runs: the host's accesses meanwhile are kept, in the memory as queued
            session.rt.hb.expect_late_host_accesses()
            regions = session.host.regions.frozen()  # LMCache #4830
        stamp: list[Any] = []
        space = session.rt._block_space

        def run() -> None:
            if found is None and isinstance(stamp[0], OpStamp):
                late = self._resolve(model, model.declare(inner_args, host_values), [host_args, session.memory, regions])
                self._declare_late(late, stamp[0], space, ids)
            forward(runs, *inner_args)

        if found is None:
            if session.graphs is not None and session.graphs.current() is not None:
                raise unroutable(f"{model.name} captured in a CUDA graph",
                                 "its accesses depend on device values the simulator reads only as it runs")
            stamp.append(session.enqueue(run, name=name))
            return None
        reads, writes = list(found.reads), found.writes
        cache: Any
        if session.block_map is not None:
            cache = CacheAccess(found.cache_read, found.cache_written)
        else:
            cache = bool(found.cache_written)
            reads += [Placed(block, key, "cache", found.cache_read) for key, block in found.cache_blocks.items()
                      if found.cache_read]
        stamp.append(session.enqueue(run, name=name, reads=reads, writes=writes, cache_written=cache))
        if isinstance(stamp[0], OpStamp):
            self._host_pending(found, stamp[0])
        return None

    def _resolve(self, model: EffectModel, fx: Any, memories: list[Any]) -> _Resolved:
        """``fx``'s runs by the memory they fall in, an error naming the first no memory holds."""
        placed = []
        for runs, write in ((fx.reads, False), (fx.writes, True)):
            # split: runs merged over allocations laid side by side (sanitizer.gpu.custom.declare)
            found, unplaced = place(runs, memories, split=True)
            if unplaced:
                raise self._outside(model, *unplaced[0], write)
            placed.append(found)
        return _Resolved(*placed)

    def _outside(self, model: EffectModel, lo: int, hi: int, write: bool) -> InterceptError:
        verb = "writes" if write else "reads"
        return unroutable(f"{model.name} in {self.session.call}",
                          f"its effect model says it {verb} {hi - lo} bytes at 0x{lo:x} "
                          f"({self.session.describe_address(lo)}), memory the harness does not know "
                          f"(pageable host memory, or the model's arithmetic)",
                          "check the model against the op's kernel (docs/fuzz-your-offloader.md, 'Custom ops')")

    def _declare_late(self, found: _Resolved, stamp: OpStamp, space: Any, ids: tuple[int, ...]) -> None:
        """Declare what the op touches as it runs (its values are there now)."""
        session = self.session
        hb = session.rt.hb
        for kind in ("device", "pinned"):
            for key, reads, writes in found.by_key(kind):
                for runs, write in ((reads, False), (writes, True)):
                    if runs and kind == "pinned":
                        hb.late_host_access(key, stamp, write=write, ranges=runs)
                    if runs:
                        hb.device_access(key, stamp, write=write, ranges=runs, late=True)
        if session.block_map is not None:
            for runs, write in ((found.cache_read, False), (found.cache_written, True)):
                for block in sorted(session.block_map.of_runs(runs)):
                    hb.device_access(("block", space, block), stamp, write=write, late=True)
        else:
            if found.cache_written:
                for block in ids:
                    hb.device_access(("block", space, int(block)), stamp, write=True, late=True)
            if found.cache_read:
                for key in found.cache_blocks:
                    hb.device_access(key, stamp, write=False, ranges=found.cache_read, late=True)

    def _host_pending(self, found: _Resolved, stamp: OpStamp) -> None:
        """Pinned bytes the op reads or writes when it runs: pending until the host has seen it."""
        hb = self.session.rt.hb
        for key, reads, writes in found.by_key("pinned"):
            if reads:
                hb.copy_reads_host(key, stamp, reads)
            if writes:
                hb.copy_writes_host(key, stamp, writes)

    # -- CUDA (the fuzzer's cuda backend) ------------------------------------------------------------
    def cuda(self, model: EffectModel, func: Any, args: tuple, kwargs: dict) -> Any:
        """Issue ``func`` (the extension's own op), or where the program has none (``func`` None) the
        model's reference (its copies on the device, :mod:`racecheck.raw_copies`), as one runtime op
        with the model's accesses: on controlled cuda behind the op's gate on its stream, the copies in
        order, run when the schedule runs the op."""
        session = self.session
        given = model.bind(args, kwargs, func)
        device_values = session.cuda_ops.values

        def now(tensor: torch.Tensor) -> list[int]:
            if tensor.is_cuda:  # known where the code made them from the host or known values (racecheck.device_values)
                known = device_values.values(tensor)
                if known is None:
                    raise unroutable(f"{model.name} in {session.call}",
                                     "its effect model needs values held in device memory that the code did not "
                                     "make from the host (or from values known so) or that a device op wrote "
                                     "since, and the fuzzer reads no device memory at the call on CUDA",
                                     "build the table on the host and copy it to the device while the tool runs, "
                                     "or run it on the simulator (--backend sim)")
                return [int(v) for v in known.reshape(-1)]
            return host_values(tensor)

        if func is None and model.reference is None:
            raise unroutable(f"{model.name} on CUDA", "its extension is not installed here and its effect model has "
                             "no reference implementation", "install the extension, or give effect_model(...) a "
                             "reference=")

        fx = model.declare(given, now)
        cache = session.cuda_ops._cache_storages
        storages = Extents.of_storages(given, lambda t: None if not t.is_cuda else
                                       "cache" if t.untyped_storage().data_ptr() in cache else "device")
        memories = [_host_arguments(given, session.host), storages, session.host.regions]
        if session.block_map is not None:
            memories.insert(2, _CacheBytes(session.block_map))
        found = self._resolve(model, fx, memories)
        cache_access: Any = (CacheAccess(found.cache_read, found.cache_written)
                             if session.block_map is not None else bool(found.cache_written))
        box: list[Any] = []

        def issue() -> None:
            if func is not None:
                box.append(forward(func, *args, **kwargs))
                return
            # The values the accesses were declared from, whatever the device holds when the op runs.
            with known_values(lambda tensor: now(tensor)):
                box.append(forward(model.reference, *given))

        stamp = session.enqueue(issue, name=model.short_name, reads=found.reads, writes=found.writes,
                                cache_written=cache_access)
        if isinstance(stamp, OpStamp):
            self._host_pending(found, stamp)
        return box[0] if box else None


def _host_arguments(given: list[Any], host: Any) -> Extents:
    """The op's host tensor arguments outside pinned memory: the host reads them at the call, as
    the extension's C++ does."""
    from kvdevice.intercept.sim_tensor import SimCudaTensor

    return Extents.of_storages(given, lambda t: "host" if not isinstance(t, SimCudaTensor) and not t.is_cuda
                               and host.lookup(t) is None else None)


def _runs_on_the_host(func: Any) -> bool:
    """Whether ``func`` (the program's op) has a kernel a CPU tensor reaches: a ``torch.library``
    op the program defined with a CPU or device-generic implementation."""
    has = getattr(func, "has_kernel_for_dispatch_key", None)
    if has is None:
        return False
    try:
        return any(has(key) for key in ("CPU", "CompositeExplicitAutograd", "CompositeImplicitAutograd"))
    except Exception:  # noqa: BLE001 - an op torch cannot answer for: not run
        return False


__all__ = ["CustomCalls", "op_name", "unmodelled"]

