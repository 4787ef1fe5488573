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
from racecheck.ranges import merge
from kvdevice.intercept.errors import InterceptError, forward, unroutable
from kvdevice.intercept.cache_access import CacheAccess

MODEL_FIX = "or run the engine where its extension is installed (a GPU, --backend cuda --cuda-mode free)"


def unmodelled(name: str) -> InterceptError:
    """The harness error for custom op ``name`` with no effect model."""
    return InterceptError(f"custom op {name}: {missing_model(name)}")


class Touch:
    """Runs of one memory key an op reads or writes (what ``Runtime.launch`` declares)."""

    __slots__ = ("key", "ranges", "block")

    def __init__(self, key: Any, ranges: list[tuple[int, int]], block: Any = None) -> None:
        self.key, self.ranges, self.block = key, ranges, block
        if block is None:
            del self.block  # ProgramSession reads ``.block`` of device memory only


class _Resolved:
    """A model's runs, sorted by the memory they fall in."""

    def __init__(self) -> None:
        self.device: dict[Any, tuple[Any, list, list]] = {}  # key -> (block or None, read runs, write runs)
        self.host: dict[Any, tuple[Any, list, list]] = {}  # region key -> (region, read runs, write runs)
        self.cache_read: list[tuple[int, int]] = []
        self.cache_written: list[tuple[int, int]] = []
        self.cache_blocks: dict[Any, Any] = {}  # key -> block (the simulator's cache memory)

    def touches(self) -> tuple[list[Touch], list[Touch]]:
        reads = [_touch(key, block, r) for key, (block, r, _) in self.device.items() if r]
        writes = [_touch(key, block, w) for key, (block, _, w) in self.device.items() if w]
        reads += [Touch(key, r) for key, (_, r, _) in self.host.items() if r]
        writes += [Touch(key, w) for key, (_, _, w) in self.host.items() if w]
        return reads, writes


def _touch(key: Any, block: Any, runs: list) -> Touch:
    return Touch(key, merge(runs), block) if block is not None else Touch(key, merge(runs))


class CustomCalls:
    """Modelled custom ops of one session (see the module docstring)."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self._host_args: list[tuple[int, int]] = []

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
        name = _short(model.name)
        if model.reference is None:
            raise unroutable(f"{model.name} on the simulator", "its effect model has no reference implementation",
                             "give effect_model(...) a reference= (a CPU implementation) " + MODEL_FIX)

        def now(tensor: torch.Tensor) -> list[int]:
            if id(tensor) in on_device:
                raise ValueUnknown("device memory, written by work still queued")
            return host_values(tensor)

        # A host tensor argument (a block mapping, a table of addresses) is read by the host at the
        # call; only pinned memory is the device's to read later.
        self._host_args = _host_extents(given, session.host)
        try:
            found = self._resolve_sim(model, model.declare(inner_args, now))
        except ValueUnknown:
            found = None
        ids, host_args = session.ids, self._host_args
        regions = None
        if found is None:  # declared as it runs: the host's accesses meanwhile are kept, in the memory as queued
            session.rt.hb.expect_late_host_accesses()
            regions = session.host.regions.frozen()  # LMCache #4830
        stamp: list[Any] = []
        space = session.rt._block_space

        def run() -> None:
            if found is None and isinstance(stamp[0], OpStamp):
                self._host_args = host_args
                late = self._resolve_sim(model, model.declare(inner_args, host_values), regions)
                self._declare_late(late, stamp[0], space, ids)
            forward(model.reference, *inner_args)

        if found is None:
            if session.graphs is not None and session.graphs.current() is not None:
                raise unroutable(f"{model.name} captured in a CUDA graph",
                                 "its accesses depend on device values the simulator reads only as it runs")
            stamp.append(session.enqueue(run, name=name))
            return None
        reads, writes = found.touches()
        cache: Any
        if session.block_map is not None:
            cache = CacheAccess(merge(found.cache_read), merge(found.cache_written))
        else:
            cache = bool(found.cache_written)
            reads += [Touch(key, merge(found.cache_read), block) for key, block in found.cache_blocks.items()
                      if found.cache_read]
        stamp.append(session.enqueue(run, name=name, reads=reads, writes=writes, cache_written=cache))
        if isinstance(stamp[0], OpStamp):
            self._host_pending(found, stamp[0])
        return None

    def _resolve_sim(self, model: EffectModel, fx: Any, regions: Any = None) -> _Resolved:
        """``fx``'s runs by the memory they fall in; ``regions``: the pinned regions to resolve host
        bytes in (those when the op was queued), else those now."""
        session = self.session
        regions = regions if regions is not None else session.host.regions
        found = _Resolved()
        for runs, write in ((fx.reads, False), (fx.writes, True)):
            for lo, hi in merge(runs):
                if any(start <= lo and hi <= end for start, end in self._host_args):
                    continue  # read by the host at the call
                block = session.memory.block_at(lo)
                if block is not None and hi <= block.end:
                    if block.cache_tensor is not None:
                        (found.cache_written if write else found.cache_read).append((lo, hi))
                        found.cache_blocks[block.key] = block
                        continue
                    entry = found.device.setdefault(block.key, (block, [], []))
                    entry[2 if write else 1].append((lo, hi))
                    continue
                region = regions.find(lo)
                if region is not None and hi <= region.end:
                    entry = found.host.setdefault(region.key, (region, [], []))
                    entry[2 if write else 1].append((lo, hi))
                    continue
                raise self._outside(model, lo, hi, write)
        return found

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
        for key, (_, reads, writes) in found.device.items():
            for runs, write in ((reads, False), (writes, True)):
                if runs:
                    hb.device_access(key, stamp, write=write, ranges=merge(runs), late=True)
        for key, (_, reads, writes) in found.host.items():
            for runs, write in ((reads, False), (writes, True)):
                if runs:
                    hb.late_host_access(key, stamp, write=write, ranges=merge(runs))
                    hb.device_access(key, stamp, write=write, ranges=merge(runs), late=True)
        if session.block_map is not None:
            for runs, write in ((found.cache_read, False), (found.cache_written, True)):
                for block in sorted(session.block_map.of_runs(merge(runs))):
                    hb.device_access(("block", space, block), stamp, write=write, late=True)
        else:
            if found.cache_written:
                for block in ids:
                    hb.device_access(("block", space, int(block)), stamp, write=True, late=True)
            if found.cache_read:
                for key in found.cache_blocks:
                    hb.device_access(key, stamp, write=False, ranges=merge(found.cache_read), late=True)

    def _host_pending(self, found: _Resolved, stamp: OpStamp) -> None:
        """Pinned bytes the op reads or writes when it runs: pending until the host has seen it."""
        hb = self.session.rt.hb
        for key, (_, reads, writes) in found.host.items():
            if reads:
                hb.copy_reads_host(key, stamp, merge(reads))
            if writes:
                hb.copy_writes_host(key, stamp, merge(writes))

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
        host_args = _host_extents(given, session.host)
        storages = {}
        for value in given:
            if isinstance(value, torch.Tensor) and value.is_cuda:
                storage = value.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        cache = session.cuda_ops._cache_storages
        found = _Resolved()
        for runs, write in ((fx.reads, False), (fx.writes, True)):
            for lo, hi in merge(runs):
                if any(start <= lo and hi <= end for start, end in host_args):
                    continue  # read by the host at the call
                base = next((b for b, n in storages.items() if b <= lo and hi <= b + n), None)
                if base is not None or (session.block_map is not None and session.block_map.contains(lo)):
                    if base in cache or base is None:
                        (found.cache_written if write else found.cache_read).append((lo, hi))
                        continue
                    entry = found.device.setdefault(("cudamem", base), (None, [], []))
                    entry[2 if write else 1].append((lo, hi))
                    continue
                region = session.host.regions.find(lo)
                if region is not None and hi <= region.end:
                    entry = found.host.setdefault(region.key, (region, [], []))
                    entry[2 if write else 1].append((lo, hi))
                    continue
                raise self._outside(model, lo, hi, write)
        reads, writes = found.touches()
        cache_access: Any = (CacheAccess(merge(found.cache_read), merge(found.cache_written))
                             if session.block_map is not None else bool(found.cache_written))
        box: list[Any] = []

        def issue() -> None:
            if func is not None:
                box.append(forward(func, *args, **kwargs))
                return
            # The values the accesses were declared from, whatever the device holds when the op runs.
            with known_values(lambda tensor: now(tensor)):
                box.append(forward(model.reference, *given))

        stamp = session.enqueue(issue, name=_short(model.name), reads=reads, writes=writes, cache_written=cache_access)
        if isinstance(stamp, OpStamp):
            self._host_pending(found, stamp)
        return box[0] if box else None


def _host_extents(given: list[Any], host: Any) -> list[tuple[int, int]]:
    """[start, end) of the op's host tensor arguments outside pinned memory (the host reads them at
    the call, as the extension's C++ does)."""
    from kvdevice.intercept.sim_tensor import SimCudaTensor

    extents = []
    for value in given:
        if isinstance(value, torch.Tensor) and not isinstance(value, SimCudaTensor) and not value.is_cuda:
            if host.lookup(value) is None:
                storage = value.untyped_storage()
                extents.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    return extents


def _short(name: str) -> str:
    """How a report names the op: ``swap_blocks``, ``multi_layer_block_kv_transfer``."""
    return name.replace("::", ".").rpartition(".")[2]


__all__ = ["CustomCalls", "Touch", "op_name", "unmodelled"]
