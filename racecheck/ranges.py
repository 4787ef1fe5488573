"""The bytes a tensor view covers, as runs of addresses ``[start, end)``.

Two accesses conflict only where their bytes meet, so an access is recorded as the runs of
memory its view covers, not as its whole allocation: ``kv[3]`` and ``kv[7]`` of one KV tensor are
different memory, and so are the rows an ``index_select`` gathers and the rows another stream
writes meanwhile. A view's elements form runs: its innermost dimensions that are laid out back to
back make one run, and every combination of the outer indices starts another. A view with more
than ``limit`` runs is given as its extent (first byte to last), which covers every element
and some bytes between them: more than it touches, never less.

Example::

    kv = torch.zeros(8, 4)                       # rows of 16 bytes
    byte_runs(kv[2:4])                           # [(base + 32, base + 64)]
    byte_runs(kv[:, 1])                          # 8 runs of 4 bytes
    row_runs(kv, 0, [1, 5])                      # [(base + 16, base + 32), (base + 80, base + 96)]
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

Runs = list[tuple[int, int]]
LIMIT = 4096  # runs listed one by one; beyond it a view is given as its extent


def _layout(sizes: Sequence[int], strides: Sequence[int], itemsize: int) -> tuple[int, list[tuple[int, int]]]:
    """(bytes of one contiguous run, [(size, byte stride)] of the outer dimensions, outermost first)."""
    dims = sorted(((st, sz) for sz, st in zip(sizes, strides) if sz != 1 and st != 0), reverse=True)
    run = itemsize
    while dims and dims[-1][0] * itemsize == run:
        stride, size = dims.pop()
        run *= size
    return run, [(size, stride * itemsize) for stride, size in dims]


def _runs(start: int, sizes: Sequence[int], strides: Sequence[int], itemsize: int, limit: int) -> Runs | None:
    if any(s == 0 for s in sizes):
        return []
    run, outer = _layout(sizes, strides, itemsize)
    if math.prod(size for size, _ in outer) > limit:
        return None
    starts = [start]
    for size, stride in outer:
        starts = [s + i * stride for s in starts for i in range(size)]
    return merge((s, s + run) for s in starts)


def extent(tensor: torch.Tensor) -> Runs:
    """The first to the last byte ``tensor``'s elements occupy, as one run (none when it is empty)."""
    if tensor.numel() == 0:
        return []
    start = tensor.data_ptr()
    span = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride())) + 1
    return [(start, start + span * tensor.element_size())]


def byte_runs(tensor: torch.Tensor, limit: int = LIMIT) -> Runs:
    """The runs of bytes ``tensor``'s elements occupy (its extent beyond ``limit`` runs)."""
    if tensor.is_contiguous():
        start = tensor.data_ptr()
        size = tensor.numel() * tensor.element_size()
        return [(start, start + size)] if size else []
    found = _runs(tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.element_size(), limit)
    return extent(tensor) if found is None else found


def row_runs(tensor: torch.Tensor, dim: int, rows: Iterable[int], limit: int = LIMIT) -> Runs:
    """The runs of bytes of ``tensor.select(dim, r)`` for every ``r`` in ``rows`` (negative rows
    count from the end; rows out of range are skipped: the op that names them fails on its own)."""
    sizes, strides = list(tensor.shape), list(tensor.stride())
    if not sizes:
        return byte_runs(tensor, limit)
    dim %= len(sizes)
    size, stride = sizes[dim], strides[dim]
    itemsize = tensor.element_size()
    if dim == 0 and tensor.is_contiguous():  # the common case (a KV tensor's blocks): a row is one run
        base, row = tensor.data_ptr(), (tensor.numel() // size if size else 0) * itemsize
        if not row:
            return []
        merged: Runs = []  # merge() of the rows' runs, built in order: each row is one run, adjacent ones join
        for r in sorted({r % size for r in rows if -size <= r < size}):
            lo = base + r * row
            if merged and merged[-1][1] == lo:
                merged[-1] = (merged[-1][0], lo + row)
            else:
                merged.append((lo, lo + row))
        return merged
    inner_sizes, inner_strides = sizes[:dim] + sizes[dim + 1:], strides[:dim] + strides[dim + 1:]
    base = tensor.data_ptr()
    found: Runs = []
    for row in sorted({r % size for r in rows if -size <= r < size}):
        runs = _runs(base + row * stride * itemsize, inner_sizes, inner_strides, itemsize, limit)
        if runs is None or len(found) > limit:
            return byte_runs(tensor, limit)
        found.extend(runs)
    return merge(found)


def merge(runs: Iterable[tuple[int, int]]) -> Runs:
    """Sorted, non-overlapping runs covering the same bytes."""
    merged: Runs = []
    for start, end in sorted(runs):
        if merged and merged[-1][1] >= start:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def clip(runs: Runs, start: int, end: int) -> Runs:
    """The parts of ``runs`` inside ``[start, end)``."""
    return [(max(s, start), min(e, end)) for s, e in runs if s < end and start < e]
