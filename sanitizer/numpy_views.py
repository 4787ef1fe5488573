"""Numpy views of pinned memory whose reads and writes the sanitizer sees as they happen.

Engines stage host data through numpy views of pinned tensors: vLLM's ``CpuGpuBuffer`` takes
``self.np = self.cpu.numpy()`` once and the scheduler reads and writes ``buf.np[...]`` from then on.
Indexing a numpy array is no torch call, so without help a read of ``buf.np`` under a pending
device-to-host copy (vLLM #36013) would be invisible, and a write would be found only at the next
call the sanitizer sees, between two program lines. While a sanitizer runs, ``Tensor.numpy()`` of a
pinned tensor returns a :class:`WatchedArray`: the same memory, an ``np.ndarray`` subclass whose
indexing, assignment, ufuncs (``+=``, ``out=``), numpy functions (``np.copyto``, ``np.cumsum(...,
out=)``) and the usual methods (``tolist``, ``item``, ``copy``, ``fill``, ``sort``, ``int(a[0])``)
tell the active watch which bytes they read or write, at which program line. Slices of it are
watched arrays too; results that are new memory are plain arrays.

What it cannot see: a plain ``np.ndarray`` made from it (``np.asarray(a)``, ``a.view(np.ndarray)``,
a C extension's buffer), ``memoryview``/``bytes``/``ctypes`` access. Host writes through those are
still found by the snapshots (:mod:`racecheck.pinned`); host reads through them are shown only in
force mode (docs/sanitizer.md).

Example::

    arr = watched(pinned.numpy())     # what Tensor.numpy() returns under the sanitizer
    arr[:2] = [3, 4]                  # -> watch.numpy_access(runs of arr[:2], write=True, ...)
    n = int(arr[0])                   # -> a read of arr[0]'s 8 bytes
"""

from __future__ import annotations

import functools

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from racecheck.ranges import Runs, merge
from sanitizer.sites import caller_site


class Watch(Protocol):
    def numpy_access(self, runs: Runs, *, write: bool, what: str, site: Any) -> None: ...


_ACTIVE: list[Watch] = []  # the watch of the running sanitizer (a stack: the innermost is used)


def activate(watch: Watch) -> Callable[[], None]:
    """Send watched arrays' accesses to ``watch`` until the returned function is called."""
    _ACTIVE.append(watch)
    return lambda: deactivate(watch)


def deactivate(watch: Watch) -> None:
    """Stop sending watched arrays' accesses to ``watch`` (a watch no longer active is left alone)."""
    if watch in _ACTIVE:
        _ACTIVE.remove(watch)


def watches() -> list[Watch]:
    """The watches active now, innermost last (the one watched arrays report to)."""
    return list(_ACTIVE)


def array_runs(array: np.ndarray, limit: int = 4096) -> Runs:
    """The byte runs of ``array``'s elements (its extent beyond ``limit`` runs)."""
    if array.size == 0:
        return []
    start = array.__array_interface__["data"][0]
    itemsize = array.itemsize
    dims = sorted(((abs(st), sz) for sz, st in zip(array.shape, array.strides) if sz != 1 and st != 0),
                  reverse=True)
    run = itemsize
    while dims and dims[-1][0] == run:
        stride, size = dims.pop()
        run *= size
    count = 1
    for _, size in dims:
        count *= size
    low = start + sum((sz - 1) * st for sz, st in zip(array.shape, array.strides) if st < 0)
    if count > limit or any(st < 0 for st in array.strides):
        high = start + sum((sz - 1) * st for sz, st in zip(array.shape, array.strides) if st > 0) + itemsize
        return [(low, high)]
    starts = [start]
    for stride, size in dims:
        starts = [s + i * stride for s in starts for i in range(size)]
    return merge((s, s + run) for s in starts)


def _report(array: np.ndarray, write: bool, what: str, runs: Runs | None = None) -> None:
    if not _ACTIVE:
        return
    watch = _ACTIVE[-1]
    watch.numpy_access(array_runs(array) if runs is None else runs, write=write, what=what,
                       site=caller_site(3))


def _plain(value: Any) -> Any:
    if isinstance(value, WatchedArray):
        return value.view(np.ndarray)
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _watched_in(value: Any) -> list["WatchedArray"]:
    if isinstance(value, WatchedArray):
        return [value]
    if isinstance(value, (list, tuple)):
        return [w for v in value for w in _watched_in(v)]
    return []


_WRITES_FIRST = {np.copyto, np.put, np.place, np.putmask, np.fill_diagonal}
# What only looks at an array's shape, type or address: no element is read.
_METADATA = {np.shape, np.ndim, np.size, np.may_share_memory, np.shares_memory, np.result_type, np.iscomplexobj,
             np.isrealobj, np.isfortran, np.min_scalar_type}


class WatchedArray(np.ndarray):
    """A numpy view of pinned memory that reports its reads and writes (module docstring)."""

    def __getitem__(self, index: Any) -> Any:
        result = super().__getitem__(index)
        is_array = isinstance(result, np.ndarray)
        if _ACTIVE and not (is_array and _overlap(result, self)):  # a view: nothing read yet
            # an array elsewhere: fancy indexing copied the elements it names; else one element was read
            _report(self, False, "read through the buffer's numpy view",
                    _selected(self, index) if is_array else _element(self, index))
        return result

    def __setitem__(self, index: Any, value: Any) -> None:
        if _ACTIVE:
            for source in _watched_in(value):
                _report(source, False, "read through the buffer's numpy view")
            target = _target(self, index)
            _report(self, True, "host write through the buffer's numpy view", target)
        super().__setitem__(index, _plain(value))

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, out: Any = None, **kwargs: Any) -> Any:
        if _ACTIVE:
            what = f"np.{ufunc.__name__}"
            read = inputs
            if method == "at" and isinstance(inputs[0], WatchedArray):  # np.add.at(a, indices, v): those elements
                at = _selected(inputs[0], inputs[1]) if len(inputs) > 1 else None
                _report(inputs[0], True, f"host write through the buffer's numpy view ({what}.at)", at)
                read = inputs[1:]
            # An elementwise call with where= computes only the elements the mask selects: it reads
            # and writes those alone (a reduction's where= selects its input's elements, not its out's).
            where = kwargs.get("where", True) if method == "__call__" else True
            for array in _watched_in(read):
                _report(array, False, f"read through the buffer's numpy view ({what})",
                        None if where is True else _masked(array, where))
            for array in _watched_in(out):
                _report(array, True, f"host write through the buffer's numpy view ({what})",
                        None if where is True else _masked(array, where))
        args = _plain(inputs)
        if out is not None:
            kwargs["out"] = _plain(out)
        result = getattr(ufunc, method)(*args, **kwargs)
        if out is not None:
            return out[0] if isinstance(out, tuple) and len(out) == 1 else out
        return result

    def __array_function__(self, func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
        read: list[WatchedArray] = []
        if _ACTIVE and func not in _METADATA:
            written = _watched_in(kwargs.get("out"))
            what = f"np.{func.__name__}"
            if func is np.take and args and isinstance(args[0], WatchedArray):
                _report(args[0], False, f"read through the buffer's numpy view ({what})",
                        _taken(args[0], args[1:], kwargs))
                skip = [args[0]]
            elif func in _WRITES_FIRST and args and isinstance(args[0], WatchedArray):
                target = args[0]
                _report(target, True, f"host write through the buffer's numpy view ({what})",
                        _written_by(func, target, args, kwargs))
                skip = [target]
            else:
                skip = []
            for array in written:
                _report(array, True, f"host write through the buffer's numpy view ({what})")
            read = [a for a in _watched_in(list(args) + [v for k, v in kwargs.items() if k != "out"])
                    if not any(a is w for w in written + skip)]
        result = func(*_plain(args), **_plain(kwargs))
        if read and not (isinstance(result, np.ndarray) and any(_overlap(result, a) for a in read)):
            for array in read:  # a function that only made a view of its input read nothing
                _report(array, False, f"read through the buffer's numpy view (np.{func.__name__})")
        out = kwargs.get("out")
        if out is not None and isinstance(result, np.ndarray) and not isinstance(result, WatchedArray):
            return out[0] if isinstance(out, tuple) else out
        return result


def _touches(name: str, write: bool) -> Callable[..., Any]:
    method = getattr(np.ndarray, name)
    what = "host write through" if write else "read through"

    def call(self: WatchedArray, *args: Any, **kwargs: Any) -> Any:
        if _ACTIVE:
            _report(self, write, f"{what} the buffer's numpy view (.{name})")
        return method(self.view(np.ndarray), *args, **kwargs)

    call.__name__ = name
    return call


def _take(self: "WatchedArray", *args: Any, **kwargs: Any) -> Any:
    """``a.take(indices, axis=...)``: a read of the elements it names."""
    if _ACTIVE:
        _report(self, False, "read through the buffer's numpy view (.take)", _taken(self, args, kwargs))
    return np.ndarray.take(self.view(np.ndarray), *_plain(args), **_plain(kwargs))


WatchedArray.take = _take  # type: ignore[method-assign]

# Methods that read or write every element without passing through the hooks above.
for _name in ("tolist", "item", "copy", "astype", "tobytes", "flatten", "__int__", "__float__", "__index__",
              "__bool__", "__iter__", "__reduce__", "__copy__", "__deepcopy__", "__repr__", "__str__", "fill", "sort"):
    setattr(WatchedArray, _name, _touches(_name, write=_name in ("fill", "sort")))


def watched(array: np.ndarray) -> WatchedArray:
    """``array`` (a numpy view of pinned memory) as a :class:`WatchedArray` over the same memory."""
    return array if isinstance(array, WatchedArray) else array.view(WatchedArray)


def _element(array: np.ndarray, index: Any) -> Runs | None:
    """The bytes of the single element ``array[index]`` (None: not a plain element index)."""
    if not isinstance(index, tuple):
        index = (index,)
    if len(index) != array.ndim or not all(isinstance(i, (int, np.integer)) for i in index):
        return None
    offset = 0
    for i, size, stride in zip(index, array.shape, array.strides):
        i = int(i)
        if not -size <= i < size:
            return None  # numpy raised already
        offset += (i % size) * stride
    start = array.__array_interface__["data"][0] + offset
    return [(start, start + array.itemsize)]


def _target(array: np.ndarray, index: Any) -> Runs | None:
    """The bytes ``array[index] = ...`` writes (None: the whole array, for fancy indexing)."""
    element = _element(array, index)
    if element is not None:
        return element
    try:
        view = np.ndarray.__getitem__(array.view(np.ndarray), index)
    except (IndexError, TypeError, ValueError):
        return None
    if isinstance(view, np.ndarray) and _overlap(view, array):
        return array_runs(view)
    return _selected(array, index)  # fancy indexing: the elements it names


MAX_SELECTED = 1 << 20  # elements an index is resolved over; a larger array counts whole


def _offsets(array: np.ndarray) -> np.ndarray:
    """Each element's byte offset from the array's start, in the array's shape (read-only)."""
    if array.size > MAX_CACHED_OFFSETS:
        return _offsets_of.__wrapped__(array.shape, array.strides)
    return _offsets_of(array.shape, array.strides)


MAX_CACHED_OFFSETS = 1 << 16  # at most 16 layouts of 512 KiB of offsets each are kept


@functools.lru_cache(maxsize=16)  # a buffer's view is indexed step after step with the same layout
def _offsets_of(shape: tuple[int, ...], strides: tuple[int, ...]) -> np.ndarray:
    indices = np.indices(shape, dtype=np.int64, sparse=True)  # one broadcastable index per dimension
    offsets = sum((index * stride for index, stride in zip(indices, strides)), np.zeros(shape, dtype=np.int64))
    offsets.flags.writeable = False
    return offsets


def _runs_of(array: np.ndarray, offsets: np.ndarray) -> Runs:
    start, size = array.__array_interface__["data"][0], array.itemsize
    return merge((start + int(o), start + int(o) + size) for o in np.unique(offsets))


def _selected(array: np.ndarray, index: Any) -> Runs | None:
    """The bytes of the elements ``array[index]`` names (None: the whole array)."""
    if array.size > MAX_SELECTED:
        return None
    try:
        chosen = np.ndarray.__getitem__(_offsets(array), _plain(index))
    except (IndexError, TypeError, ValueError):
        return None
    return _runs_of(array, np.asarray(chosen).reshape(-1))


def _written_by(func: Any, array: np.ndarray, args: tuple, kwargs: dict) -> Runs | None:
    """The bytes ``np.put``/``np.place``/``np.putmask`` write of ``array`` (None: all of it)."""
    if array.size > MAX_SELECTED or len(args) < 2:
        return None
    if func is np.copyto:  # np.copyto(dst, src, casting, where): where=True (all) unless given
        where = kwargs["where"] if "where" in kwargs else args[3] if len(args) > 3 else True
        return None if where is True else _masked(array, where)
    offsets = _offsets(array)
    try:
        if func is np.put:
            chosen = offsets.reshape(-1)[np.asarray(_plain(args[1])).reshape(-1) % array.size]
        elif func in (np.place, np.putmask):
            chosen = offsets[np.asarray(_plain(args[1]), dtype=bool)]
        else:
            return None
    except (IndexError, TypeError, ValueError):
        return None
    return _runs_of(array, chosen.reshape(-1))


def _masked(array: np.ndarray, where: Any) -> Runs | None:
    """The bytes of the elements of ``array`` a ``where=`` mask (broadcast to its shape) selects
    (None: the whole array)."""
    if array.size > MAX_SELECTED:
        return None
    try:
        chosen = _offsets(array)[np.broadcast_to(np.asarray(_plain(where), dtype=bool), array.shape)]
    except (IndexError, TypeError, ValueError):
        return None
    return _runs_of(array, chosen.reshape(-1))


def _taken(array: np.ndarray, args: tuple, kwargs: dict) -> Runs | None:
    """The bytes ``np.take(array, *args, **kwargs)`` reads: ``take`` of the elements' offsets with the
    same indices, axis and mode names exactly those elements (None: the whole array)."""
    if array.size > MAX_SELECTED or not (args or "indices" in kwargs):
        return None
    args, kwargs = _plain(tuple(args)), _plain(kwargs)
    indices = args[0] if args else kwargs["indices"]
    axis = args[1] if len(args) > 1 else kwargs.get("axis")  # take(indices, axis, out, mode): never out here
    mode = args[3] if len(args) > 3 else kwargs.get("mode", "raise")
    try:
        chosen = np.take(_offsets(array), indices, axis=axis, mode=mode)
    except (IndexError, TypeError, ValueError):
        return None
    return _runs_of(array, np.asarray(chosen).reshape(-1))


def _overlap(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a`` lies in ``b``'s memory (a view of it), by bounds: a copy is new memory."""
    return bool(np.may_share_memory(a.view(np.ndarray), b.view(np.ndarray)))
