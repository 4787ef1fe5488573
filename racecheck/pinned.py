"""Pinned host memory: where it is, and the bytes that queued copies will read from it.

A non-blocking copy (or a kernel) reads pinned memory when its stream reaches it, so the host
rewriting that memory before then changes what arrives (vLLM #48085). The host writes staging
memory through numpy views (``buf.numpy()[:n] = ids``), ``ctypes.memmove`` or torch ops; only the
last is a call anything sees. So:

* :class:`PinnedMemory` knows every pinned region by address: allocations
  (``torch.empty(pin_memory=True)``, ``.pin_memory()``, the pinned result of
  ``.to("cpu", non_blocking=True)``) and memory registered with ``cudaHostRegister`` (SGLang's host
  KV pool), so any tensor over those bytes (a view, ``torch.from_numpy`` of a numpy view) is found;
* :class:`Snapshot` keeps the bytes a queued read will see, as they were when it was queued;
  :class:`PendingReads` compares them at every boundary the caller sees (an op, a stream or event
  call, the end of a scope): a difference is a host write under a pending read. Snapshots read
  memory with ``ctypes`` alone, never through torch, so no mode or patch sees the checker at work;
* a queued device-to-host copy changes the bytes it writes without any host write, so snapshots of
  those bytes are dropped (:meth:`PendingReads.drop`); once the host has seen the copy complete,
  later reads of them are snapshotted again. A buffer's history never switches its checks off.

Example::

    memory = PinnedMemory()
    buf = torch.zeros(8, dtype=torch.int64)            # pinned on a GPU machine
    region = memory.add_tensor(buf, "staging")
    reads = PendingReads()
    reads.add(Snapshot.of(region, buf[:2], stamp))
    buf.numpy()[0] = 7                                 # no torch op
    reads.changed(seen=lambda stamp: False)            # -> [the snapshot]: a host write under it
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from racecheck.clocks import OpStamp
from racecheck.placement import Placed
from racecheck.ranges import Runs, byte_runs, clip
from racecheck.shadow import overlaps

_INT = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
MAX_PENDING = 4096  # snapshots kept; beyond it the oldest are dropped (a miss, never a false race)


@dataclass(eq=False)
class Region:
    """One pinned allocation, or memory registered with ``cudaHostRegister``."""

    id: int
    start: int
    end: int
    name: str
    origin: str = ""  # how it was made: torch.empty(pin_memory=True), cudaHostRegister, ...
    site: Any = None  # where it was made, for a report's "allocated at"
    base: torch.Tensor | None = None  # the tensor it was registered from, where the caller keeps it
    registered: bool = False  # cudaHostRegister: outside the caching allocator
    layout: str = ""  # "(8,) int32", for a region that does not hold its tensor (one torch may free)

    @property
    def key(self) -> tuple:
        return ("pinned", self.id)

    def runs(self, tensor: torch.Tensor) -> Runs:
        """The bytes of ``tensor`` inside this region."""
        return clip(byte_runs(tensor), self.start, self.end)


class PinnedMemory:
    """Every pinned region of one process or session, by address."""

    def __init__(self, ids: Iterator[int] | None = None) -> None:
        self._ids = ids if ids is not None else itertools.count(1)
        self._starts: list[int] = []
        self._regions: list[Region] = []

    def _overlapped(self, start: int, end: int) -> tuple[int, int]:
        """``[j, i)``: the positions of the regions ``[start, end)`` overlaps."""
        i = j = bisect.bisect_left(self._starts, end)  # regions starting before ``end``: [0, i)
        while j > 0 and self._regions[j - 1].end > start:
            j -= 1
        return j, i

    def overlapping(self, start: int, end: int) -> list[Region]:
        """The regions ``[start, end)`` overlaps (those a new region there makes forgotten)."""
        j, i = self._overlapped(start, end)
        return self._regions[j:i]

    def add(self, start: int, end: int, name: str = "", **details: Any) -> Region:
        """A pinned region ``[start, end)``; regions it overlaps are forgotten (the memory is new)."""
        j, i = self._overlapped(start, end)
        del self._starts[j:i], self._regions[j:i]
        region = Region(next(self._ids), start, end, name, **details)
        i = bisect.bisect(self._starts, start)
        self._starts.insert(i, start)
        self._regions.insert(i, region)
        return region

    def add_tensor(self, tensor: torch.Tensor, name: str = "", **details: Any) -> Region:
        """The whole storage of ``tensor`` as a region."""
        storage = tensor.untyped_storage()
        start = storage.data_ptr()
        return self.add(start, start + max(storage.nbytes(), 1), name, **details)

    def remove(self, region: Region) -> None:
        if region in self._regions:
            i = self._regions.index(region)
            del self._starts[i], self._regions[i]

    def find(self, address: int) -> Region | None:
        """The region holding ``address``, if any."""
        i = bisect.bisect(self._starts, address) - 1
        if i >= 0 and address < self._regions[i].end:
            return self._regions[i]
        return None

    def holding(self, start: int, end: int) -> Placed | None:
        """The bytes of ``[start, end)`` the region holding ``start`` holds (:class:`racecheck.placement.Memories`)."""
        region = self.find(start)
        return None if region is None else Placed(region, region.key, "pinned", [(start, min(end, region.end))])

    def of(self, tensor: torch.Tensor) -> Region | None:
        """The region ``tensor`` (a CPU tensor, maybe a view) lives in, if any."""
        if tensor.device.type != "cpu":
            return None
        address = tensor.data_ptr() if tensor.numel() else tensor.untyped_storage().data_ptr()
        return self.find(address)

    def regions(self) -> list[Region]:
        return list(self._regions)

    def frozen(self) -> "PinnedMemory":
        """These regions as they are now, unchanged by later allocations: what an op queued now
        reads, where its addresses are resolved only as it runs (the allocator may have handed the
        bytes to a new tensor by then)."""
        copy = PinnedMemory(self._ids)
        copy._starts, copy._regions = list(self._starts), list(self._regions)
        return copy

    def __len__(self) -> int:
        return len(self._regions)


def read_runs(runs: Runs) -> bytes:
    """The bytes of ``runs`` now, read with ctypes (no torch call)."""
    if len(runs) == 1:
        start, end = runs[0]
        return ctypes.string_at(start, end - start)
    return b"".join(ctypes.string_at(start, end - start) for start, end in runs)


@dataclass(eq=False)
class Snapshot:
    """The bytes a queued read (``stamp``) of pinned memory will see, as they were when queued."""

    region: Region
    runs: Runs
    raw: bytes
    stamp: OpStamp
    dtype: torch.dtype = torch.uint8
    shape: tuple[int, ...] = ()
    keep: Any = None  # what keeps the memory alive while the read is pending (the caller's choice)
    extra: dict = field(default_factory=dict)  # the caller's own data (force mode's gate, ...)

    @classmethod
    def of(cls, region: Region, view: torch.Tensor, stamp: OpStamp, keep: Any = None) -> "Snapshot":
        runs = region.runs(view)
        return cls(region, runs, read_runs(runs), stamp, view.dtype, tuple(view.shape), keep)

    def changed(self) -> bool:
        return read_runs(self.runs) != self.raw

    def values(self, raw: bytes | None = None) -> np.ndarray:
        """The elements (as same-width integers, so bytes compare exactly, NaN included) of ``raw``
        (default: the bytes staged when the read was queued)."""
        data = self.raw if raw is None else raw
        size = self.dtype.itemsize
        integer = _INT.get(size)
        if integer is None or self.dtype.is_complex or len(data) % size:
            return np.frombuffer(data, dtype=np.uint8)
        array = np.frombuffer(data, dtype=integer)
        count = int(np.prod(self.shape)) if self.shape else 1
        return array.reshape(self.shape) if array.size == count else array

    def now(self) -> np.ndarray:
        """The elements as they are now (force mode: what a held copy is about to read)."""
        return self.values(read_runs(self.runs))


class PendingReads:
    """Snapshots of the pinned bytes queued reads will see (see the module docstring).

    Snapshots of the same bytes of the same region, taken while they held the same values (a
    staging buffer copied again and again before the host syncs), are one group, compared once:
    the bytes differ for all of them or for none, so a check costs one comparison per group, not
    one per queued read (a loop that queues a thousand copies of one buffer would otherwise compare
    it a thousand times at every op). Within a group, snapshots of reads seen complete and of
    memory gone are dropped at every check while it is small; once it is larger, those of reads
    seen complete from its oldest on at every check, and all of them each time it has doubled since
    it was last pruned whole, or when the snapshots are over the limit (then the oldest live ones
    go only after that)."""

    def __init__(self, limit: int = MAX_PENDING) -> None:
        # (region id, runs, bytes) -> [(order added, snapshot)], oldest first; groups in the order made
        self._groups: dict[tuple[int, tuple[tuple[int, int], ...], bytes], list[tuple[int, Snapshot]]] = {}
        self._prune_at: dict[tuple[int, tuple[tuple[int, int], ...], bytes], int] = {}
        self._count = 0
        self._added = itertools.count()
        self.limit = limit

    def add(self, snapshot: Snapshot) -> None:
        key = (snapshot.region.id, tuple(snapshot.runs), snapshot.raw)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = []
        group.append((next(self._added), snapshot))
        self._count += 1
        # The limit is kept at each check, where reads seen complete are dropped first (here nothing
        # says which are); between checks, twice the limit at most.
        while self._count > 2 * self.limit:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        key = min(self._groups, key=lambda k: self._groups[k][0][0])
        group = self._groups[key]
        del group[0]
        self._count -= 1
        if not group:
            self._remove(key)

    def _remove(self, key: tuple[int, tuple[tuple[int, int], ...], bytes]) -> None:
        self._count -= len(self._groups.pop(key))
        self._prune_at.pop(key, None)

    def drop(self, region: Region, runs: Runs) -> None:
        """A queued device-to-host copy will write ``runs`` of ``region``: their bytes change
        without a host write, so the snapshots over them can no longer tell."""
        for key, group in list(self._groups.items()):
            if group[0][1].region is region and overlaps(group[0][1].runs, runs):
                self._remove(key)

    def forget(self, region: Region) -> None:
        for key, group in list(self._groups.items()):
            if group[0][1].region is region:
                self._remove(key)

    def changed(self, seen: Callable[[OpStamp], bool],
                gone: Callable[[Snapshot], bool] | None = None) -> list[Snapshot]:
        """The snapshots whose bytes differ now, of reads not ``seen`` complete, in the order added;
        each is reported once and dropped, with the snapshots of reads seen complete and those
        ``gone`` (memory nothing but the snapshot holds any more: nothing can write it)."""
        if not self._groups:
            return []
        found: list[tuple[int, Snapshot]] = []
        emptied = []
        over = self._count > self.limit  # then every group is pruned whole before any live read is dropped
        for key, group in self._groups.items():
            if group[0][1].changed():
                found.extend(item for item in group if not seen(item[1].stamp))
                emptied.append(key)
                continue
            whole = over or len(group) <= _PRUNE_ALWAYS or len(group) >= self._prune_at.get(key, 0)
            if whole:
                kept = [item for item in group if not seen(item[1].stamp) and (gone is None or not gone(item[1]))]
            else:  # reads seen complete from the oldest on (one stream's, in its order): amortized once each
                first = 0
                while first < len(group) and seen(group[first][1].stamp):
                    first += 1
                kept = group[first:]
            if not kept:
                emptied.append(key)
                continue
            self._count -= len(group) - len(kept)
            group[:] = kept
            if len(kept) <= _PRUNE_ALWAYS:
                self._prune_at.pop(key, None)
            elif whole:
                self._prune_at[key] = 2 * len(kept)  # pruned whole again once it has doubled
        for key in emptied:
            self._remove(key)
        while self._count > self.limit:
            self._drop_oldest()
        if not found:
            return []
        found.sort(key=lambda item: item[0])
        return [snapshot for _, snapshot in found]

    def __iter__(self) -> Iterator[Snapshot]:
        items = [item for group in self._groups.values() for item in group]
        items.sort(key=lambda item: item[0])
        return iter([snapshot for _, snapshot in items])

    def __bool__(self) -> bool:
        return bool(self._groups)

    def __len__(self) -> int:
        return self._count


_PRUNE_ALWAYS = 4  # a group this small is pruned at every check (as every snapshot was); a larger one when it doubles


class PinnedWatch:
    """Pinned memory watched for one happens-before checker: queued copies that read or write it,
    and host accesses, seen (a call) or found (a snapshot that changed).

    ``hb`` is a :class:`racecheck.hb.HappensBefore`; ``host`` says which of its host threads is
    asking (:class:`racecheck.threads.HostThreads.current`).
    """

    def __init__(self, hb: Any, host: Callable[[], int], ids: Iterator[int] | None = None) -> None:
        self.hb = hb
        self.host = host
        self.regions = PinnedMemory(ids)
        self.pending = PendingReads()

    # -- regions -----------------------------------------------------------------------------------
    def register(self, tensor: torch.Tensor, name: str = "", *, keep: bool = True, **details: Any) -> Region:
        """``tensor``'s storage as a pinned region (``keep``: the region holds the tensor)."""
        with torch._C.DisableTorchFunction():
            region = self.regions.add_tensor(tensor, name, base=tensor if keep else None, **details)
        self.hb.forget(region.key)
        self.hb.name_resource(region.key, region.name or f"pinned host buffer p{region.id}")
        return region

    def register_range(self, start: int, nbytes: int, name: str = "", **details: Any) -> Region:
        """``[start, start + nbytes)`` registered as pinned (``cudaHostRegister``): outside the
        caching allocator, which frees nothing behind a pending copy."""
        region = self.regions.add(start, start + nbytes, name, registered=True, **details)
        self.hb.name_resource(region.key, region.name or f"registered host memory p{region.id}")
        return region

    def unregister_range(self, start: int) -> bool:
        region = self.regions.find(start)
        if region is None or not region.registered:
            return False
        self.regions.remove(region)
        self.pending.forget(region)
        return True

    def rename(self, region: Region, name: str) -> None:
        region.name = name
        self.hb.name_resource(region.key, name)

    def lookup(self, tensor: Any) -> Region | None:
        """The pinned region ``tensor`` (a CPU tensor, maybe a view) lives in, if any."""
        if not isinstance(tensor, torch.Tensor) or not self.regions:
            return None
        with torch._C.DisableTorchFunction():
            return self.regions.of(tensor)

    # -- queued copies -----------------------------------------------------------------------------
    def note_read(self, region: Region, view: torch.Tensor, stamp: OpStamp, keep: Any = None) -> Snapshot | None:
        """A queued op (``stamp``) reads ``view`` of ``region`` when its stream reaches it; the
        snapshot of what it will read, unless a queued device-to-host copy may change those bytes
        first (then only the order of the two copies is checked)."""
        hb = self.hb
        with torch._C.DisableTorchFunction():
            snapshot = Snapshot.of(region, view, stamp, keep)
        hb.copy_reads_host(region.key, stamp, snapshot.runs)
        # Device work on host memory, ordered by the streams like any device access (a bounce
        # buffer filled by a device-to-host copy on one stream and read back on another).
        hb.device_access(region.key, stamp, write=False, ranges=snapshot.runs)
        if hb.pending_writes(region.key, self.host(), snapshot.runs):
            return None
        self.pending.add(snapshot)
        return snapshot

    def note_device_write(self, region: Region, view: torch.Tensor, stamp: OpStamp) -> list[tuple[int, int]]:
        """A queued device-to-host copy (``stamp``) writes ``view`` of ``region`` when it runs;
        the runs it writes."""
        hb = self.hb
        with torch._C.DisableTorchFunction():
            runs = region.runs(view)
        hb.copy_writes_host(region.key, stamp, runs)
        hb.device_access(region.key, stamp, write=True, ranges=runs)
        self.pending.drop(region, runs)
        return runs

    # -- host accesses -----------------------------------------------------------------------------
    def changed(self, gone: Callable[[Snapshot], bool] | None = None) -> list[Snapshot]:
        """Snapshots of pending reads whose bytes the host changed (no call showed it)."""
        if not self.pending:
            return []
        hb, host = self.hb, self.host()
        return self.pending.changed(lambda stamp: hb.host_has_seen(stamp, host), gone)

    def check(self, label: str) -> list[Snapshot]:
        """Compare every pending read's bytes with its snapshot; report host writes as ``label``."""
        found = self.changed()
        host = self.host() if found else 0
        for snapshot in found:
            self.hb.host_write(snapshot.region.key, label, host, snapshot.runs)
        return found

    def host_write(self, region: Region, view: torch.Tensor | None, label: str) -> None:
        """The host writes ``view`` of ``region`` (None: all of it) now, through a call seen (the
        snapshots of those bytes are dropped: what they would find is reported here)."""
        self.host_access_runs(region, self._runs(region, view), label, write=True)

    def host_read(self, region: Region, view: torch.Tensor | None, label: str) -> None:
        """The host reads ``view`` of ``region`` (None: all of it) now, through a call seen."""
        self.host_access_runs(region, self._runs(region, view), label, write=False)

    def host_access_runs(self, region: Region, runs: Runs, label: str, *, write: bool) -> None:
        """The host reads or writes ``runs`` of ``region`` now (a numpy view's bytes, say)."""
        if write:
            self.hb.host_write(region.key, label, self.host(), runs)
            self.pending.drop(region, runs)
        else:
            self.hb.host_read(region.key, label, self.host(), runs)

    def pending_write(self, region: Region, view: torch.Tensor | None = None) -> bool:
        """Whether a queued device-to-host copy the asking thread has not seen complete writes
        ``view`` of ``region``."""
        return bool(self.hb.pending_writes(region.key, self.host(), self._runs(region, view)))

    @staticmethod
    def _runs(region: Region, view: torch.Tensor | None) -> Runs:
        if view is None:
            return [(region.start, region.end)]
        with torch._C.DisableTorchFunction():
            return region.runs(view)
