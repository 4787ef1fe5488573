"""Which memory holds a run of raw addresses: one record for bytes placed in a memory, one resolver.

Both tools meet raw addresses: a table kernel loads them from a table (vLLM's ``_swap_blocks_kernel``),
a custom op's model computes them (SGLang's tables of layer addresses), a driver call takes them
(``cuMemcpyBatchAsync``). Each backend says which of its memories holds an address (:class:`Memories`:
the simulator's device memory, the CUDA allocations a tool tracks, pinned and registered host memory,
an op's own arguments as :class:`Extents`); :func:`place` asks them in order. What none holds comes
back, for the caller's error or partial line: bytes moved where a tool cannot see are named, never
dropped. A :class:`Placed` is also what ``Runtime.launch`` declares: a memory key and its runs touched.

Example::

    memories = [Extents([(0x1000, 0x1100, "a", ("cudamem", 0x1000), "device")])]
    placed, unplaced = place([(0x1010, 0x1020), (0x2000, 0x2004)], memories)   # one Placed per run
    assert placed[0].key == ("cudamem", 0x1000) and unplaced == [(0x2000, 0x2004)]
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from racecheck.ranges import Runs, merge

KINDS = ("device", "cache", "pinned", "host")  # cache: the KV cache's bytes; host: the host's, at the call


@dataclass(eq=False, slots=True)
class Placed:
    """Bytes of one memory: what holds them (a simulated block, a pinned region, a CUDA allocation's
    first byte), what the happens-before checker calls it, its kind (:data:`KINDS`), and the runs
    touched (sorted, disjoint; None: all of it)."""

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
    """A backend's memories: the one holding ``start``, with the bytes of ``[start, end)`` it holds
    (one run, from ``start`` to ``end`` or the memory's end), or None."""

    def holding(self, start: int, end: int) -> Placed | None: ...


class Extents:
    """Memories given as (start, end, memory, key, kind) extents: an op's tensor arguments, say."""

    def __init__(self, extents: Iterable[tuple[int, int, Any, Any, str]]) -> None:
        self._extents = sorted(extents, key=lambda e: e[0])
        self._starts = [e[0] for e in self._extents]

    def holding(self, start: int, end: int) -> Placed | None:
        i = bisect.bisect_right(self._starts, start) - 1  # extents do not overlap: the last to start before
        lo, hi, memory, key, kind = self._extents[i] if i >= 0 else (0, 0, None, None, "")
        return Placed(memory, key, kind, [(start, min(end, hi))]) if lo <= start < hi else None

    @classmethod
    def of_storages(cls, tensors: Iterable[Any], kind: Callable[[Any], str | None]) -> "Extents":
        """The storages of ``tensors`` of the kind ``kind(tensor)`` says (None: left out), each named
        by its first byte, keyed as the tools key CUDA memory unless it is the host's."""
        extents = []
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and (what := kind(tensor)) is not None:
                start, size = tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()
                extents.append((start, start + size, start, None if what == "host" else ("cudamem", start), what))
        return cls(extents)


def place(runs: Iterable[tuple[int, int]], memories: Sequence[Memories], *,
          split: bool = False) -> tuple[list[Placed], Runs]:
    """``runs`` (merged) placed in ``memories``, the first that holds a whole run taking it: one
    :class:`Placed` per run, in address order, and the runs none holds whole. With ``split``, a run
    past its memory's end is cut there, and its rest placed on its own (a kernel's merged words may
    cross from one allocation into the next)."""
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
                first = first or held
            part = part or (first if split else None)
            if part is None:
                unplaced.append((lo, hi))
                break
            placed.append(part)
            lo = part.end
    return placed, unplaced


def by_memory(placed: Iterable[Placed], kinds: Sequence[str] = KINDS) -> list[Placed]:
    """``placed`` of ``kinds``, one per memory (its runs merged), in the order first met."""
    found: dict[Any, Placed] = {}
    for part in placed:
        if part.kind in kinds:
            entry = found.setdefault((part.kind, part.key), Placed(part.memory, part.key, part.kind, []))
            entry.ranges = merge([*entry.ranges, *(part.ranges or ())])
    return list(found.values())


__all__ = ["Extents", "KINDS", "Memories", "Placed", "by_memory", "place"]
