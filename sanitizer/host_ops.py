"""Host ops on pinned memory: a torch op on a CPU tensor that lives in pinned memory is a host read
or a host write of those bytes, the same on the GPU and on the simulator.

``buf.fill_(0)``, ``buf[:n].copy_(src)``, ``buf + 1``, ``buf.sum()``, ``int(buf[0])`` (``.item()``,
``aten._local_scalar_dense``) and every other aten op on the CPU side reach the sanitizer's
dispatch mode; the tensors among its arguments that are pinned are read, or written where the op's
schema marks them ``(a!)``. Each is checked, at the op's own line, against the copies pending on
those bytes: a write against queued copies that read or write them (vLLM #48085), a read against
queued device-to-host copies that write them (vLLM #36013). An indexed op (``buf[ids] = v``,
``buf.index_fill_(0, ids, 0)``, ``buf.index_select(0, ids)``) touches only the rows its index names,
as vLLM's pinned block tables are filled row by row while an earlier row's copy is queued.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch

from racecheck.dtypes import NUMPY_INTEGERS
from racecheck.ops import SET_STORAGE, args_by_position, indexed_rows, kind, masked_rows, op_info, op_name
from racecheck.ranges import Runs, merge, row_runs
from sanitizer.sites import Site, caller_site

aten = torch.ops.aten
MAX_INDEX = 1 << 16  # elements of a host index whose values are read to narrow an access to rows
_INDEX_DTYPES = {**NUMPY_INTEGERS, torch.bool: np.bool_}  # a boolean mask's values are read too


def pinned_access(watch: Any, func: Any, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> Site | None:
    """Check ``func``'s host reads and writes of pinned memory (``watch`` is a
    :class:`~sanitizer.watch.HostWatch`); the op's site when it touches any, else None."""
    if kind(func) in ("view", "alloc") or func in SET_STORAGE:
        return None  # metadata only: a view (or set_ onto a storage) reads nothing yet
    lookup = watch.pinned.lookup
    pinned = [t for t in tensors if lookup(t) is not None]
    if not pinned:
        return None
    site = caller_site()
    written = written_tensors(func, args, kwargs)
    name = op_name(func)
    indexed = _indexed_target(func, args, kwargs)
    masked = _masked_target(func, args, kwargs) if indexed is None else None
    with watch.lock:
        watch.boundary(site)
        for tensor in pinned:
            if indexed is not None and tensor is indexed[0]:
                _, dim, rows, writes = indexed
                region = watch.region_of(tensor)
                verb = "write" if writes else "read"
                label = watch.host_label(f"host {verb} ({name} of rows of the pinned buffer)", site)
                watch.pinned.host_access_runs(region, row_runs(tensor, dim, rows), label, write=writes)
                watch.collect()
            elif masked is not None and tensor is masked[0]:
                label = watch.host_label(f"host write ({name} of the mask's elements of the pinned buffer)", site)
                watch.pinned.host_access_runs(watch.region_of(tensor), masked[1], label, write=True)
                watch.collect()
            elif any(tensor is w for w in written):
                watch.host_access(tensor, write=True, what=f"host write ({name} on the pinned buffer)", site=site)
            else:
                watch.host_access(tensor, write=False, what=f"host read ({name} of the pinned buffer)", site=site)
    return site


def _indexed_target(func: Any, args: tuple, kwargs: dict) -> tuple[torch.Tensor, int, list[int], bool] | None:
    """(the indexed tensor, dim, the rows its host index names, whether the op writes them) for an
    indexed op whose index values can be read here; None otherwise (the whole tensor is taken)."""
    found = indexed_rows(func, args, kwargs)
    masked = found is None
    if masked:
        found = masked_rows(func, args, kwargs)  # x[mask]: the rows are the mask's True positions
        if found is None:
            return None
    at, dim, index, writes = found
    given = args_by_position(func, args, kwargs)
    target = given[at] if at < len(given) else None
    rows = _host_values(index)
    if masked and rows is not None:
        rows = [i for i, chosen in enumerate(rows) if chosen]
    if not isinstance(target, torch.Tensor) or rows is None:
        return None
    return target, dim, rows, writes


_MASKED_WRITES = {aten.masked_fill_.Scalar, aten.masked_fill_.Tensor, aten.masked_scatter_.default}


def _masked_target(func: Any, args: tuple, kwargs: dict) -> tuple[torch.Tensor, Runs] | None:
    """(the tensor, the runs of the elements its mask selects) for ``x.masked_fill_(mask, v)`` and
    ``x.masked_scatter_(mask, src)`` on the host with a host mask whose values can be read: torch's
    CPU kernels write only those elements, so a write to the other rows of a pinned buffer is not a
    write to rows a queued copy is reading. None for any other op (the whole tensor is taken)."""
    if func not in _MASKED_WRITES:
        return None
    given = args_by_position(func, args, kwargs)
    target, mask = given[0], given[1] if len(given) > 1 else None
    if not isinstance(target, torch.Tensor) or not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        return None
    values = _host_values(mask)
    if values is None or target.numel() > MAX_INDEX:
        return None
    try:
        chosen = np.broadcast_to(np.asarray(values, dtype=bool).reshape(tuple(mask.shape)), tuple(target.shape))
    except ValueError:
        return None  # torch raises on its own
    size = target.element_size()
    offsets = sum((index * stride for index, stride in zip(np.nonzero(chosen), target.stride())),
                  np.zeros(int(chosen.sum()), dtype=np.int64))
    start = target.data_ptr()
    return target, merge((start + int(o) * size, start + (int(o) + 1) * size) for o in offsets)


def _host_values(index: torch.Tensor) -> list[int] | None:
    """The values of a small CPU integer index, read from its memory (no torch op: this runs inside
    the dispatch mode); None when they cannot be read that way."""
    dtype = _INDEX_DTYPES.get(index.dtype)
    if dtype is None or index.device.type != "cpu" or index.numel() > MAX_INDEX or not index.is_contiguous():
        return None
    if index.numel() == 0:
        return []
    raw = ctypes.string_at(index.data_ptr(), index.numel() * index.element_size())
    return np.frombuffer(raw, dtype=dtype).tolist()


def tensors_of(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among an aten op's arguments (lists of tensors included)."""
    found: list[torch.Tensor] = []
    for value in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


def written_tensors(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors ``func`` writes in place (its schema's ``(a!)`` arguments)."""
    positions = op_info(func).written
    if not positions:
        return []
    positional = args_by_position(func, args, kwargs)
    return [positional[i] for i in positions if i < len(positional) and isinstance(positional[i], torch.Tensor)]
