"""Which memory holds a run of raw addresses: one record for bytes placed in a memory, one resolver.

Engines hand both tools raw addresses: a table kernel loads them from a table (vLLM's
``_swap_blocks_kernel``), a custom op's model computes them (SGLang's tables of layer addresses),
a driver call takes them (``cuMemcpyBatchAsync``). Each run of bytes is placed in the one memory
that holds it before the happens-before checker can be told what an op touches. Each backend says
which of its memories holds an address (:class:`Memories`): the simulator's device memory, the CUDA
allocations a tool tracks, pinned and registered host memory (:class:`racecheck.pinned.PinnedMemory`),
an op's own tensor arguments (:class:`Extents`). :func:`place` asks them in order; what none holds
comes back as runs, for the caller to report as the harness's error or the run's partial line
(never dropped: bytes moved where the tool cannot see are named).

A :class:`Placed` is also what ``Runtime.launch`` declares: a memory key and the runs of it touched.

Example::

    memories = [Extents([(0x1000, 0x1100, "a", ("cudamem", 0x1000), "device")])]
    placed, unplaced = place([(0x1010, 0x1020), (0x2000, 0x2004)], memories)   # one Placed per run
    assert placed[0].key == ("cudamem", 0x1000) and placed[0].ranges == [(0x1010, 0x1020)]
    assert unplaced == [(0x2000, 0x2004)]
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from racecheck.ranges import Runs, merge

KINDS = ("device", "cache", "pinned", "host")  # "cache": the KV cache's bytes; "host": read by the host at the call


@dataclass(eq=False, slots=True)
class Placed:
    """Bytes of one memory: what holds them (``memory``: a simulated device block, a pinned or
    registered host region, a CUDA allocation's first byte, ...), what the happens-before checker
    calls it (``key``), which kind of memory it is (:data:`KINDS`), and the runs touched (sorted,
    disjoint; None: all of it, for a memory named by its key alone)."""

    memory: Any
    key: Any
    kind: str = "device"
    ranges: Runs | None = None

    @classmethod
    def whole(cls, memory: Any) -> "Placed":
        """``memory`` (a block, a key, a Placed) as ``Runtime.launch`` declares it."""
        if isinstance(memory, Placed):
            return memory
        return cls(memory, getattr(memory, "key", memory), "device", getattr(memory, "ranges", None))

    @property
    def start(self) -> int:
        return self.ranges[0][0] if self.ranges else 0

    @property
    def end(self) -> int:
        return self.ranges[-1][1] if self.ranges else 0


class Memories(Protocol):
    """A backend's memories: the one that holds ``start``, with the bytes of ``[start, end)`` it
    holds (a Placed whose one run starts at ``start`` and ends at ``end`` or where the memory ends);
    None where none of them holds ``start``."""

    def holding(self, start: int, end: int) -> Placed | None: ...


class Extents:
    """Memories given as (start, end, memory, key, kind) extents: an op's tensor arguments, say."""

    def __init__(self, extents: Iterable[tuple[int, int, Any, Any, str]]) -> None:
        self._extents = sorted(extents, key=lambda e: e[0])
        self._starts = [e[0] for e in self._extents]

    def holding(self, start: int, end: int) -> Placed | None:
        i = bisect.bisect_right(self._starts, start) - 1
        while i >= 0:  # extents may nest (views of one storage): the widest holding start that starts latest
            lo, hi, memory, key, kind = self._extents[i]
            if lo <= start < hi:
                return Placed(memory, key, kind, [(start, min(end, hi))])
            i -= 1
        return None

    @classmethod
    def of_storages(cls, tensors: Iterable[Any], kind: Callable[[Any], str | None]) -> "Extents":
        """The storages of ``tensors`` as ``kind(tensor)`` says they are (None: left out), each
        the memory of its first byte, keyed as the tools key CUDA memory (``("cudamem", address)``)
        unless it is the host's."""
        extents = []
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and (what := kind(tensor)) is not None:
                storage = tensor.untyped_storage()
                start = storage.data_ptr()
                extents.append((start, start + storage.nbytes(), start, None if what == "host" else ("cudamem", start),
                                what))
        return cls(extents)


def place(runs: Iterable[tuple[int, int]], memories: Sequence[Memories], *,
          split: bool = False) -> tuple[list[Placed], Runs]:
    """``runs`` (merged first) placed in ``memories``, asked in order (the first that holds a whole
    run takes it): one :class:`Placed` per run, in address order; and the runs no memory holds
    whole, in order. A run that goes on past the end of its memory is unplaced, unless ``split``:
    then the first memory that holds its first byte takes what it holds, and the rest is placed on
    its own (a kernel's merged words may cross from one allocation into the next)."""
    placed: list[Placed] = []
    unplaced: Runs = []
    for lo, hi in merge(runs):
        while lo < hi:
            part = first = None
            for memory in memories:
                held = memory.holding(lo, hi)
                if held is not None and held.end >= hi:
                    part = held
                    break
                first = first or (held if held is not None and held.end > lo else None)
            part = part or (first if split else None)
            if part is None:
                unplaced.append((lo, hi))
                break
            placed.append(part)
            lo = part.end
    return placed, unplaced


def by_memory(placed: Iterable[Placed], kinds: Sequence[str] = KINDS) -> list[Placed]:
    """``placed`` of ``kinds``, one :class:`Placed` per memory (its runs merged), in the order first met."""
    found: dict[Any, Placed] = {}
    for part in placed:
        if part.kind in kinds:
            entry = found.get((part.kind, part.key))
            if entry is None:
                found[(part.kind, part.key)] = Placed(part.memory, part.key, part.kind, list(part.ranges or ()))
            else:
                entry.ranges = merge([*entry.ranges, *(part.ranges or ())])
    return list(found.values())


__all__ = ["Extents", "KINDS", "Memories", "Placed", "by_memory", "place"]
