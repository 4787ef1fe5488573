"""The simulator's meaning of every aten op on a :class:`SimCudaTensor`, as CUDA would run it.

:func:`racecheck.ops.kind` says what an op does; this module does it on the simulator:
views at once, allocations from :class:`~kvdevice.intercept.sim_memory.SimDeviceMemory` on the
current stream, queued ops as one runtime op each (their outputs allocated now, from the op's
meta kernel, and filled when the stream reaches them), copies by :func:`~racecheck.ops.copy_kind`,
and blocking ops after the current stream has run (``Runtime.run_now``). Each queued op declares the
device blocks it reads and writes to the happens-before checker; one that writes the KV cache
declares the blocks of the zero call it belongs to.

Example (what ``idx.copy_(pinned[:n], non_blocking=True)`` becomes)::

    session.sim_ops.dispatch(torch.ops.aten.copy_.default, (idx, pinned_view, True), {})
    # -> a queued op "copy_ (h2d)" that reads pinned_view's bytes when the stream reaches it
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map

from kvdevice.intercept.errors import forward, unroutable
from racecheck.custom_ops import is_custom, model_for
from racecheck.ops import SET_STORAGE, aliased_returns, args_by_position, copy_kind, host_temporary, index_needs_host, indexed_rows, kind, op_name, written_args
from racecheck.placement import Placed
from racecheck.ranges import byte_runs, merge, row_runs
from kvdevice.intercept.cache_access import CacheAccess
from kvdevice.intercept.sim_graphs import CapturedOp
from kvdevice.intercept.sim_memory import Allocation, Block
from kvdevice.intercept.sim_tensor import SimCudaTensor, uncloak


def _inner(value: Any) -> Any:
    return value._inner if isinstance(value, SimCudaTensor) else value


def _host_snapshot(value: Any) -> Any:
    # A CPU tensor handed to a device op is copied at the call (CUDA moves it before returning).
    if isinstance(value, torch.Tensor) and not isinstance(value, SimCudaTensor) and value.device.type == "cpu":
        return value.clone()
    return value


def _device_or_snapshot(value: Any) -> Any:
    """A device tensor's memory (read when the op runs), a host tensor's bytes now."""
    return value._inner if isinstance(value, SimCudaTensor) else _host_snapshot(value)


def _meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, torch.device):
        return torch.device("meta")
    return value


def storage_bytes(size: tuple[int, ...], stride: tuple[int, ...], itemsize: int) -> int:
    """Bytes a tensor of ``size`` and ``stride`` spans (0 for an empty one)."""
    if any(s == 0 for s in size):
        return 0
    return (sum((s - 1) * st for s, st in zip(size, stride)) + 1) * itemsize


class SimOps:
    """Routes aten ops on simulated CUDA tensors for one session (see the module docstring)."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.memory = session.memory

    # -- tensors ---------------------------------------------------------------------------------
    def wrap(self, inner: torch.Tensor, allocation: Allocation) -> SimCudaTensor:
        return SimCudaTensor(inner, allocation, self.session)

    def new(self, size: tuple[int, ...], dtype: torch.dtype, stride: tuple[int, ...] | None = None,
            name: str = "") -> SimCudaTensor:
        """A fresh device tensor, allocated on the current stream."""
        if stride is None:
            stride = torch.empty(size, device="meta").stride()
        nbytes = storage_bytes(tuple(size), tuple(stride), dtype.itemsize)
        where = self.session.allocation_context()
        allocation = self.memory.alloc(nbytes, self.session.rt.current_stream(),
                                       f"{name or 'a tensor'}" + (f" in {where}" if where else ""))
        self.session.device_allocated(allocation.block)
        capture = self.session.graphs.current() if self.session.graphs is not None else None
        if capture is not None:
            capture.keep.append(allocation)  # a graph's memory stays reserved for its replays (CUDA's private pool)
        return self.wrap(self.memory.tensor(allocation, tuple(size), dtype, tuple(stride)), allocation)

    def _like(self, meta: torch.Tensor, name: str) -> SimCudaTensor:
        return self.new(tuple(meta.size()), meta.dtype, tuple(meta.stride()), name)

    # -- dispatch --------------------------------------------------------------------------------
    def dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        args, kwargs = tree_map(uncloak, args), tree_map(uncloak, kwargs)
        if is_custom(func):  # an extension's op: its effect model says what it touches (racecheck.custom_ops)
            model = model_for(func)
            if model is None:
                return self.session.unmodelled_op(func, args, kwargs)
            return self.session.custom.sim(model, args, kwargs, func)
        if func in SET_STORAGE:
            return self._set(func, args, kwargs)
        if _composite(func):
            # Under torch.inference_mode() a composite op (``x.cpu()``'s ``aten.to.dtype_layout``)
            # reaches the Python key whole; its own decomposition says what CUDA would run.
            out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        what = kind(func)
        if what == "view":
            return self._view(func, args, kwargs)
        if what == "unsupported":
            raise unroutable(f"{func} on a simulated CUDA tensor", "it changes the tensor's shape or storage in place")
        if what == "alloc":
            return self._alloc(func, args, kwargs)
        if what == "copy":
            dst, src = args[0], args[1]
            non_blocking = bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False))
            return self.copy(dst, src, non_blocking)
        if what == "to_copy":
            return self._to_copy(args[0], **kwargs)
        if what == "blocking" or index_needs_host(func, args):
            return self._blocking(func, args, kwargs)
        return self._queued(func, args, kwargs)

    def _view(self, func: Any, args: tuple, kwargs: dict) -> Any:
        base = next(a for a in tree_flatten((args, kwargs))[0] if isinstance(a, SimCudaTensor))
        out = forward(func, *tree_map(_inner, args), **tree_map(_inner, kwargs))
        return tree_map(lambda t: self.wrap(t, base._alloc) if isinstance(t, torch.Tensor) else t, out)

    def _set(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``t.set_(storage, offset, size, stride)`` / ``t.set_(other)``: ``t`` now views the bytes of
        a simulated allocation (vLLM's ``register_kv_caches`` views a device storage in another
        shape). The same block, so every access through it is checked as the storage's own."""
        given = args_by_position(func, args, kwargs)
        target, source = given[0], given[1]
        if isinstance(source, SimCudaTensor):
            allocation = source._alloc
            inner = torch.empty(0, dtype=target.dtype).set_(source._inner)
        else:
            storage = source.untyped_storage() if isinstance(source, torch.Tensor) else source
            storage = getattr(storage, "_untyped_storage", storage)  # a TypedStorage's bytes
            block = self.memory.block_at(storage.data_ptr())
            allocation = self.memory.allocation_of(block) if block is not None else None
            if allocation is None or storage.data_ptr() + storage.nbytes() > block.end:
                raise unroutable(f"{func} on a simulated CUDA tensor",
                                 "the storage is not simulated device memory (set_ onto a CPU storage "
                                 "is a device mismatch on CUDA too)")
            rest = [value for value in given[2:5] if value is not None]
            if not rest:  # the whole storage: the bytes CUDA allocated, not the simulator's size class
                itemsize = target.dtype.itemsize
                rest = [0, ((block.start + block.nbytes - storage.data_ptr()) // itemsize,)]
            inner = torch.empty(0, dtype=target.dtype).set_(storage, *rest)
        replaced = self.wrap(inner, allocation)
        with torch._C.DisableTorchFunction():
            target.data = replaced  # sizes, strides and offset in place, as set_ changes them
        target._inner, target._alloc = inner, allocation
        return target

    def _alloc(self, func: Any, args: tuple, kwargs: dict) -> Any:
        meta = forward(func, *tree_map(_meta, args), **tree_map(_meta, {**kwargs, "device": "meta"} if "device" in kwargs else kwargs))
        return self._like(meta, f"{func}")

    def _accesses(self, tensors: list[SimCudaTensor], written: list[SimCudaTensor]) -> tuple[list, list, Any]:
        """(bytes read, bytes written, whether the KV cache is written): each a :class:`~racecheck.placement.Placed`, the
        block and the runs of its bytes the tensor covers, so that two views of one allocation that
        do not meet (``kv[3]`` and ``kv[7]``) are not taken for one memory. An offloader's session
        gets the cache's bytes apart, as a :class:`CacheAccess` the session maps to blocks."""
        written_ids = {id(t) for t in written}
        if self.session.block_map is not None:
            on_cache = [t for t in tensors + written if t._alloc.block.cache_tensor is not None]
            cache: Any = CacheAccess(merge([r for t in on_cache if id(t) not in written_ids for r in byte_runs(t._inner)]),
                                     merge([r for t in on_cache if id(t) in written_ids for r in byte_runs(t._inner)]))
            tensors = [t for t in tensors if t._alloc.block.cache_tensor is None]
        else:
            cache = any(t._alloc.block.cache_tensor is not None for t in written)
        reads = _spans(t for t in tensors if id(t) not in written_ids)
        return reads, _spans(t for t in written if t._alloc.block.cache_tensor is None), cache

    def _queued(self, func: Any, args: tuple, kwargs: dict) -> Any:
        try:
            metas = func(*tree_map(_meta, args), **tree_map(_meta, kwargs))
        except Exception:  # no meta kernel, or a data-dependent shape: run it as CUDA would a sync op
            return self._blocking(func, args, kwargs)
        outs_meta = metas if isinstance(metas, (tuple, list)) else (metas,)
        aliased = aliased_returns(func)
        positional = args_by_position(func, args, kwargs)
        results: list[Any] = []
        fresh: list[tuple[int, SimCudaTensor]] = []
        for i, meta in enumerate(outs_meta):
            source = aliased[i] if i < len(aliased) else None
            if source is not None:
                results.append(positional[source])
            elif isinstance(meta, torch.Tensor):
                out = self._like(meta, f"output of {func}")
                fresh.append((i, out))
                results.append(out)
            else:
                results.append(meta)
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, SimCudaTensor)]
        written = [positional[i] for i in written_args(func) if isinstance(positional[i], SimCudaTensor)]
        rows = self._indexed(func, args, kwargs)
        if rows is not None:  # its rows are declared when it runs, once its index holds its values
            tensors = [t for t in tensors if t is not rows[0]]
            written = [t for t in written if t is not rows[0]]
        reads, writes, cache = self._accesses(tensors, written + [out for _, out in fresh])
        inner_args = tree_map(_device_or_snapshot, args)
        inner_kwargs = tree_map(_device_or_snapshot, kwargs)
        targets = [(i, out._inner) for i, out in fresh]
        stamp: list[Any] = []
        hb = self.session.rt.hb

        space = self.session.rt._block_space  # which cache "block N" means, as the op is queued
        # What the queued op keeps of its tensors is their bytes, never the tensors: a kernel does not
        # keep its arguments alive on CUDA, so an index dropped once the op is queued is freed at
        # once and its block may be handed out again (SGLang #34076).
        row_target = (rows[0]._inner, rows[0]._alloc.block, rows[1], _inner(rows[2]), rows[3]) if rows else None

        def declare_rows(at: Any) -> None:  # the rows its index holds as the op runs
            target, block, dim, index, write = row_target
            runs = row_runs(target, dim, index.reshape(-1).tolist())
            if block.cache_tensor is not None:  # an offloader's op on the cache: its blocks
                for cache_block in sorted(self.session.block_map.of_runs(runs)):
                    hb.device_access(("block", space, cache_block), at, write=write, late=True)
                return
            hb.device_access(block.key, at, write=write, ranges=runs, late=True)

        def run() -> None:
            if row_target is not None and not isinstance(stamp[0], CapturedOp):
                declare_rows(stamp[0])
            res = forward(func, *inner_args, **inner_kwargs)
            res = res if isinstance(res, (tuple, list)) else (res,)
            for i, target in targets:
                target.copy_(res[i])

        stamp.append(self.session.enqueue(run, name=op_name(func), reads=reads, writes=writes, cache_written=cache))
        if rows is not None and isinstance(stamp[0], CapturedOp):
            stamp[0].declare_rows = declare_rows  # each replay declares the rows its index holds then
        if isinstance(metas, (tuple, list)):
            return type(metas)(results) if isinstance(metas, tuple) else results
        return results[0]

    def _indexed(self, func: Any, args: tuple, kwargs: dict) -> tuple[Any, int, Any, bool] | None:
        """(the indexed tensor, dim, index, writes) of an op that touches only the rows its index
        names (:func:`racecheck.ops.indexed_rows`), when they can be declared as it runs: not the
        KV cache (whose blocks the harness declares)."""
        found = indexed_rows(func, args, kwargs)
        if found is None:
            return None
        position, dim, index, write = found
        target = args[position] if position < len(args) else None
        if not isinstance(target, SimCudaTensor):
            return None
        if target._alloc.block.cache_tensor is not None and self.session.block_map is None:
            return None
        return target, dim, index, write

    def _blocking(self, func: Any, args: tuple, kwargs: dict) -> Any:
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, SimCudaTensor)]
        positional = args_by_position(func, args, kwargs)
        written = [positional[i] for i in written_args(func) if isinstance(positional[i], SimCudaTensor)]
        reads, writes, cache = self._accesses(tensors, written)
        box: list[Any] = []

        def run() -> None:
            box.append(forward(func, *tree_map(_inner, args), **tree_map(_inner, kwargs)))

        self.session.run_now(run, name=op_name(func), reads=reads, writes=writes, cache_written=cache)
        aliased = aliased_returns(func)
        result = box[0]
        if not isinstance(result, (tuple, list)):
            return self._adopt_result(result, aliased[0] if aliased else None, positional)
        return type(result)(self._adopt_result(r, aliased[i] if i < len(aliased) else None, positional)
                            for i, r in enumerate(result))

    def _adopt_result(self, value: Any, source: int | None, positional: list) -> Any:
        if source is not None:
            return positional[source]
        if isinstance(value, torch.Tensor):
            out = self.new(tuple(value.size()), value.dtype, name="result of a synchronising op")
            out._inner.copy_(value)  # the op already ran, after a sync: its result is there now
            return out
        return value

    # -- copies ----------------------------------------------------------------------------------
    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool, *, fresh: bool = False) -> torch.Tensor:
        """``dst.copy_(src)``; ``fresh``: ``dst`` is the new result of a ``.to()`` (laid out by torch)."""
        device_dst, device_src = isinstance(dst, SimCudaTensor), isinstance(src, SimCudaTensor)
        host_side = src if device_dst and not device_src else dst if device_src and not device_dst else None
        pinned = self.session.host.lookup(host_side) if host_side is not None else None
        temporary = non_blocking and device_dst != device_src and host_temporary(None if fresh else dst, src, to_device=device_dst)
        how = copy_kind(device_dst=device_dst, device_src=device_src, non_blocking=non_blocking,
                        pinned=pinned is not None, temporary=temporary)
        target, source = _inner(dst), _inner(src)
        tensors = [t for t in (dst, src) if isinstance(t, SimCudaTensor)]
        written = [dst] if device_dst else []
        reads, writes, cache = self._accesses(tensors, written)
        if how == "host":
            return forward(dst.copy_, src, non_blocking=non_blocking)
        if how == "h2d-staged":
            source = source.clone()  # CUDA stages pageable bytes before the call returns
        elif how == "h2d-async":
            source = self.session.host.by_address(source)  # the queued copy keeps an address, not the tensor
        elif how == "d2h-async":
            target = self.session.host.by_address(target)

        def run() -> None:
            forward(target.copy_, source)

        name = {"d2d": "copy_ (d2d)", "h2d-async": "copy_ (h2d)", "h2d-staged": "copy_ (h2d, staged)",
                "d2h-async": "copy_ (d2h)", "sync": "copy_ (synchronous)"}[how]
        if how == "sync":
            self.session.run_now(run, name=name, reads=reads, writes=writes, cache_written=cache)
            return dst
        stamp = self.session.enqueue(run, name=name, reads=reads, writes=writes, cache_written=cache)
        if how == "h2d-async":
            self.session.host.note_read(pinned, src, stamp)
        elif how == "d2h-async":
            self.session.host.note_device_write(pinned, dst, stamp)
        if how in ("h2d-async", "d2h-async"):
            # Copy.cu's record_event: the caching host allocator keeps the block until this stream's
            # work is done; nothing else tells it of a use (a kernel reading the pointer, say).
            self.session.host.used_by_copy(host_side, self.session.rt.current_stream())
        return dst

    def _to_copy(self, x: SimCudaTensor, *, dtype: torch.dtype | None = None, layout: Any = None,
                 device: Any = None, pin_memory: bool | None = None, non_blocking: bool = False,
                 memory_format: Any = None) -> torch.Tensor:
        dtype = dtype or x.dtype
        target = torch.device(device) if device is not None else x.device
        if target.type == "cpu":
            out = torch.zeros(tuple(x.size()), dtype=dtype)  # zeros, not garbage: a run replays the same
            # CUDA pins the result of a non-blocking move to the host (aten's _to_copy), so the copy
            # stays queued: its values are there once the stream has run it (an event, a sync).
            if pin_memory or non_blocking:
                out = self.session.host.pin(out, "pinned result of .to()")
            return self.copy(out, x, non_blocking, fresh=True)
        out = self.new(tuple(x.size()), dtype, name=".to() result")
        return self.copy(out, x, non_blocking, fresh=True)

    def to_device(self, host: torch.Tensor, dtype: torch.dtype | None, non_blocking: bool) -> SimCudaTensor:
        """``host.to('cuda', ...)`` / ``host.cuda()``: fresh device memory, never an alias of ``host``."""
        out = self.new(tuple(host.size()), dtype or host.dtype, name=".to('cuda') of a host tensor")
        source = host if dtype is None or dtype == host.dtype else host.to(dtype)
        self.copy(out, source, non_blocking, fresh=True)
        return out


def _composite(func: Any) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")


def _spans(tensors: Any) -> list[Placed]:
    """One :class:`~racecheck.placement.Placed` per block among ``tensors``, with the runs all of them cover there."""
    by_block: dict[int, tuple[Block, list[tuple[int, int]]]] = {}
    for tensor in tensors:
        block = tensor._alloc.block
        entry = by_block.setdefault(id(block), (block, []))
        entry[1].extend(byte_runs(tensor._inner))
    return [Placed(block, block.key, "device", merge(runs)) for block, runs in by_block.values()]


Runner = Callable[[], None]
