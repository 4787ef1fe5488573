"""CUDA's own tensors under interception: every aten op on one, routed to the runtime's stream.

On the cuda backend a plain torch zeroer's tensors are real CUDA tensors. This
``TorchDispatchMode`` sees every aten op while the zeroer runs and acts on its kind
(:func:`racecheck.ops.kind`): views and allocations run at once (torch allocates on its
current stream, which is the runtime's); queued ops are issued as one runtime op each, so in the
controlled mode they wait behind the op's gate until the fuzzer's schedule runs them, and in the
free-running mode they are issued at once; host copies follow
:func:`~racecheck.ops.copy_kind` (a non-blocking copy from pageable memory is staged into
fresh pinned memory first, as CUDA would stage it, so no driver staging can wait behind a gate);
synchronising ops run after the current stream has (``Runtime.run_now``).

The happens-before checker names device memory by storage address. PyTorch's caching allocator
reuses an address only for later work on the stream it was allocated on, unless ``record_stream``
tied it to others, in which case it waits for their events first (which the checker cannot see):
such an address starts a fresh history when torch hands it out again.

Example (inside an intercepted call on a GPU)::

    ids = torch.empty(8, dtype=torch.int64, device="cuda")      # at once
    ids[:2].copy_(pinned[:2], non_blocking=True)                 # one gated op on the current stream
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from kvdevice.intercept.errors import forward, unroutable
from kvdevice.intercept.cache_access import CacheAccess
from racecheck.lazy_dynamo import LazyDynamoMode, guard_once_dynamo_loaded
from racecheck.device_values import DeviceValues
from racecheck.custom_ops import is_custom, model_for
from racecheck.ops import (aliased_returns, args_by_position, copy_kind, decomposed, host_temporary, index_needs_host,
                           indexed_rows, kind, op_info, written_args)
from racecheck.placement import Placed
from racecheck.ranges import byte_runs, merge, row_runs
from racecheck.raw_copies import allocator_holding
from kvdevice.runtime import Stream


def _cuda_tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    return [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor) and a.is_cuda]


class CudaOps(LazyDynamoMode):
    """See the module docstring. A :class:`~racecheck.lazy_dynamo.LazyDynamoMode`: torch's default
    wrapper imported ``torch._dynamo`` at a campaign's first op on CUDA (4.5 s of a 16 s campaign on
    the H100 image)."""

    def __init__(self, session: Any) -> None:
        super().__init__()
        self.session = session
        self._cache_storages: set[int] = set()
        # Storages record_stream tied to another stream: one caching allocator serves every zeroer
        # of the runtime, so the set is the runtime's (kvdevice.intercept.shared).
        self._recorded: set[int] = session.share.recorded
        # The values of small integer tensors in device memory, shadowed as the code makes them: the
        # tables a Triton kernel loads its addresses from, an extension op's pointer tables
        # (racecheck.device_values; kvdevice.intercept.kernel_accesses.through_tables_on_cuda).
        self.values = DeviceValues(lambda t: t.is_cuda)
        self._precise: set[int] = set()  # storages the op being issued forgot by their written bytes

    def forget_written(self, addresses: list[int]) -> None:
        """Device memory an op writes (:meth:`kvdevice.intercept.session.InterceptSession._declare`):
        its values are unknown now, but for the bytes an aten op here wrote (forgotten by those bytes
        only, then set to what the op computes where it can be evaluated)."""
        precise, self._precise = self._precise, set()
        for address in addresses:
            if address not in precise:
                self.values.written(address)

    def _writes(self, written: list[torch.Tensor]) -> None:
        """The op about to be issued writes ``written``: those bytes, and only those, are unknown."""
        self._precise = {t.untyped_storage().data_ptr() for t in written}
        for tensor in written:
            self.values.written(tensor.untyped_storage().data_ptr(), byte_runs(tensor))

    def note_cache(self, storages: list[int]) -> None:
        self._cache_storages = set(storages)

    def key(self, tensor: torch.Tensor) -> tuple:
        return ("cudamem", tensor.untyped_storage().data_ptr())

    def holding(self, start: int, end: int) -> Placed | None:
        """Device memory a raw access lies in (:class:`racecheck.placement.Memories`), the KV cache's apart."""
        return allocator_holding(start, end, self._cache_storages)

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        self._recorded.add(tensor.untyped_storage().data_ptr())

    def _fresh(self, tensors: list[torch.Tensor]) -> None:
        """Tensors torch just allocated: an address record_stream had tied elsewhere starts anew."""
        for tensor in tensors:
            address = tensor.untyped_storage().data_ptr()
            self.values.written(address)  # new memory: nothing of it is known
            if address in self._recorded:
                self._recorded.discard(address)
                self.session.rt.hb.forget(("cudamem", address))

    def _accesses(self, tensors: list[torch.Tensor], written: list[torch.Tensor], indexed: Any = None) -> tuple[list, list, Any]:
        if self.session.block_map is not None:
            return self._offloader_accesses(tensors, written, indexed)
        write_keys = {self.key(t) for t in written}
        cache = any(k[1] in self._cache_storages for k in write_keys)
        writes = [k for k in write_keys if k[1] not in self._cache_storages]
        reads = sorted({self.key(t) for t in tensors} - write_keys - {("cudamem", s) for s in self._cache_storages})
        return reads, writes, cache

    def _offloader_accesses(self, tensors: list[torch.Tensor], written: list[torch.Tensor], indexed: Any) -> tuple[list, list, Any]:
        """An offloader's op: the cache's bytes apart, as a :class:`CacheAccess` its session maps to
        blocks. An indexed op on the cache touches the rows a host index names; rows named by device
        values are taken to be the blocks of the call."""
        storages = self._cache_storages

        def on_cache(t: torch.Tensor) -> bool:
            return t.untyped_storage().data_ptr() in storages

        written_ids = {id(t) for t in written}
        rows_unknown = False
        read_runs: list[tuple[int, int]] = []
        write_runs: list[tuple[int, int]] = []
        target = None
        if indexed is not None:  # (position, dim, index, writes, the indexed tensor)
            _, dim, index, write, target = indexed
            if on_cache(target):
                if index.device.type == "cpu":
                    (write_runs if write else read_runs).extend(row_runs(target, dim, index.reshape(-1).tolist()))
                else:
                    rows_unknown = rows_unknown or write
            else:
                target = None
        for t in tensors:
            if on_cache(t) and t is not target:
                (write_runs if id(t) in written_ids else read_runs).extend(byte_runs(t))
        for t in written:
            if on_cache(t) and t is not target and not any(t is u for u in tensors):
                write_runs.extend(byte_runs(t))
        write_keys = {self.key(t) for t in written if not on_cache(t)}
        reads = sorted({self.key(t) for t in tensors if not on_cache(t)} - write_keys)
        return reads, sorted(write_keys), CacheAccess(merge(read_runs), merge(write_runs), rows_unknown)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        guard_once_dynamo_loaded(CudaOps)
        kwargs = kwargs or {}
        if is_custom(func):  # an extension's op: its effect model says what it touches (racecheck.custom_ops)
            model = model_for(func)
            if model is None:
                return self.session.unmodelled_op(func, args, kwargs)
            result = self.session.custom.cuda(model, func, args, kwargs)
            for out in tree_flatten(result)[0]:  # what it returns holds values nothing here evaluated
                if isinstance(out, torch.Tensor) and out.is_cuda:
                    self.values.written(out.untyped_storage().data_ptr())
            return result
        if op_info(func).composite:  # under torch.inference_mode(): x.to("cuda") whole (racecheck.ops.decomposed)
            result = decomposed(self, func, args, kwargs)
            if result is not NotImplemented:
                return result
        tensors = _cuda_tensors(args, kwargs)
        device = kwargs.get("device")
        on_device = bool(tensors) or (device is not None and torch.device(device).type == "cuda")
        if not on_device:
            return forward(func, *args, **kwargs)  # host work: the zeroer's own business
        what = kind(func)
        if func is torch.ops.aten.record_stream.default:
            return forward(func, *args, **kwargs)  # the allocator's bookkeeping, on the host, now
        if what in ("view", "alloc"):
            result = forward(func, *args, **kwargs)
            if what == "alloc":
                self._fresh([result])
            return result
        if what == "unsupported":
            raise unroutable(f"{func} on a CUDA tensor", "it changes the tensor's shape or storage in place")
        if what == "copy":
            non_blocking = bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False))
            return self._copy(func, args, kwargs, args[0], args[1], non_blocking)
        if what == "to_copy":
            source = args[0]
            target = torch.device(device) if device is not None else source.device
            non_blocking = bool(kwargs.get("non_blocking", False))
            if source.is_cuda and target.type == "cpu":
                # aten's _to_copy pins the result of a non-blocking move to the host: a queued copy.
                pin = bool(kwargs.get("pin_memory")) or non_blocking
                return self._copy(func, args, kwargs, None, source, non_blocking, pin=pin)
            if not source.is_cuda and target.type == "cuda":
                return self._copy(func, args, kwargs, None, source, non_blocking, to_device=True)
        positional = args_by_position(func, args, kwargs)
        written = [positional[i] for i in written_args(func) if isinstance(positional[i], torch.Tensor) and positional[i].is_cuda]
        indexed = None
        if self.session.block_map is not None:
            found = indexed_rows(func, args, kwargs)
            if found is not None and found[0] < len(args) and isinstance(args[found[0]], torch.Tensor):
                indexed = (*found, args[found[0]])
        reads, writes, cache = self._accesses(tensors, written, indexed)
        pending = self.values.prepare(func, args, kwargs, tensors)  # on small integers: evaluated on the host
        self._writes(written)
        box: list[Any] = []

        def issue() -> None:
            box.append(forward(func, *args, **kwargs))

        name = str(func).replace("aten.", "").replace(".default", "")
        if what == "blocking" or index_needs_host(func, args):
            self.session.run_now(issue, name=name, reads=reads, writes=writes, cache_written=cache)
        else:
            self.session.enqueue(issue, name=name, reads=reads, writes=writes, cache_written=cache)
        result = box[0]
        aliased = aliased_returns(func)
        outputs = result if isinstance(result, (tuple, list)) else (result,)
        self._fresh([o for i, o in enumerate(outputs) if isinstance(o, torch.Tensor) and o.is_cuda
                     and (i >= len(aliased) or aliased[i] is None)])
        self.values.commit(pending, result)
        return result

    def _copy(self, func: Any, args: tuple, kwargs: dict, dst: torch.Tensor | None, src: torch.Tensor,
              non_blocking: bool, *, pin: bool = False, to_device: bool = False) -> Any:
        """``copy_(dst, src)``, or ``_to_copy(src)`` (``dst`` None) across devices."""
        device_dst = to_device or (dst is not None and dst.is_cuda)
        device_src = src.is_cuda
        host_side = src if device_dst and not device_src else dst if device_src and not device_dst else None
        pinned = self.session.host.lookup(host_side) if host_side is not None else None
        temporary = non_blocking and device_dst != device_src and host_temporary(dst, src, to_device=device_dst)
        how = copy_kind(device_dst=device_dst, device_src=device_src, non_blocking=non_blocking,
                        pinned=pinned is not None or (pin and not device_dst), temporary=temporary)
        if how == "h2d-staged":
            # CUDA stages pageable bytes before returning; we stage them in pinned memory, laid out as
            # the copy reads them (a pageable temporary of torch's own may wait for the gated stream)
            laid = src.expand_as(dst) if dst is not None else src
            staged = laid.contiguous().pin_memory()
            args = (args[0], staged, *args[2:]) if dst is not None else (staged, *args[1:])
        tensors = [t for t in (dst, src) if isinstance(t, torch.Tensor) and t.is_cuda]
        written = [dst] if dst is not None and dst.is_cuda else []
        reads, writes, cache = self._accesses(tensors, written)
        # the values it delivers into device memory (the host's now, or known device values)
        pending = self.values.prepare(func, args, kwargs, tensors) if device_dst else None
        self._writes(written)
        box: list[Any] = []

        def issue() -> None:
            box.append(forward(func, *args, **kwargs))

        name = f"copy ({how})"
        if how == "sync":
            self.session.run_now(issue, name=name, reads=reads, writes=writes, cache_written=cache)
        else:
            stamp = self.session.enqueue(issue, name=name, reads=reads, writes=writes, cache_written=cache)
            if how == "h2d-async" and pinned is not None:
                self.session.host.note_read(pinned, src, stamp)
            elif how == "d2h-async":
                target = dst if dst is not None else box[0]
                if pinned is None and dst is None and pin:  # .to("cpu", non_blocking=True): a fresh pinned result
                    pinned = self.session.host.register(target, "pinned result of .to()")
                if pinned is not None:
                    self.session.host.note_device_write(pinned, target, stamp)
        result = box[0]
        if dst is None and isinstance(result, torch.Tensor) and result.is_cuda:
            self._fresh([result])
        self.values.commit(pending, result)  # the values a table kernel may go through later
        if dst is None and pin and how != "d2h-async" and isinstance(result, torch.Tensor) and not result.is_cuda:
            self.session.host.register(result, "pinned result of .to()")
        return result
