"""Shadow state of one memory resource, byte range by byte range: its last write and reads since.

Two accesses conflict when they touch a common byte, at least one writes, and neither happens
before the other. A resource (a device allocation, a KV-cache block) is shadowed as segments of
its address range, each with the last write and the latest read per thread since that write
(the FastTrack scheme, per segment). An access to a few rows of a large tensor splits the segments
at its edges and checks only those; a whole-tensor access covers every segment. Segments whose
states are the same object are merged again, so a resource always written whole stays one segment.

An access may be declared after others that happen after it (an indexed op whose rows became
known only when it ran): the conflict test looks at both directions, and a state is never replaced
by an access that happens before it, so no conflict is reported between ordered accesses, whatever
the order of declaration. Declared out of order, a conflict with a write that a later write already
replaced can be missed (one last write per segment is kept): a missed race, never a false one.

Example::

    shadow = RangeShadow()
    shadow.access([(0, 64)], stamp_a, write=True)     # []
    shadow.access([(64, 128)], stamp_b, write=True)   # []: other bytes
    shadow.access(None, stamp_c, write=False)         # [(stamp_a, "writes", 0, 64), (stamp_b, ...)] if unordered
"""

from __future__ import annotations

import bisect

from racecheck.clocks import OpStamp, ordered

Ranges = list[tuple[int, int]] | None  # [start, end) byte runs; None: the whole resource
WHOLE = (0, 1 << 64)


class _State:
    """The last write and the latest read per thread since it, of some bytes (never changed once made:
    segments share states, and a new access makes a new one)."""

    __slots__ = ("last_write", "reads")

    def __init__(self, last_write: OpStamp | None, reads: tuple[OpStamp, ...]) -> None:
        self.last_write = last_write
        self.reads = reads  # the latest read per thread since the last write


_EMPTY = _State(None, ())


def _unordered(a: OpStamp, b: OpStamp) -> bool:
    return a.thread != b.thread and not ordered(a, b.vc) and not ordered(b, a.vc)


def _after(state: _State, stamp: OpStamp, write: bool) -> _State:
    """``state`` once ``stamp`` has accessed the bytes (never replaced by an earlier access)."""
    last = state.last_write
    if write:
        if last is not None and ordered(stamp, last.vc) and stamp is not last:
            return state  # a write declared late that happens before the last one: it changes nothing
        reads = state.reads
        if not reads:
            return _State(stamp, ())
        return _State(stamp, tuple(r for r in reads if ordered(stamp, r.vc) and r is not stamp))
    if last is not None and ordered(stamp, last.vc):
        return state  # a read declared late (or the writing op's own read) that the last write follows
    reads = []
    placed = False
    for read in state.reads:
        if read.thread == stamp.thread:
            reads.append(stamp if stamp.clock >= read.clock else read)
            placed = True
        else:
            reads.append(read)
    if not placed:
        reads.append(stamp)
    return _State(last, tuple(reads))


class RangeShadow:
    """The segments of one resource (see the module docstring)."""

    __slots__ = ("starts", "states")

    def __init__(self) -> None:
        self.starts: list[int] = [0]  # segment i covers [starts[i], starts[i + 1]), the last one to the end
        self.states: list[_State] = [_EMPTY]

    def access(self, ranges: Ranges, stamp: OpStamp, *, write: bool) -> list[tuple[OpStamp, str, int, int]]:
        """Record ``stamp``'s access to ``ranges``; the unordered conflicts it meets:
        (other access, "writes" or "reads", first byte, end byte), one per other access."""
        if ranges is not None and len(ranges) == 1:
            start, end = ranges[0]
            starts = self.starts
            if len(starts) == 1 and self.states[0] is _EMPTY and 0 < start < end:
                # The first access of a fresh resource (a new tensor): nothing to meet yet.
                self.starts = [0, start, end]
                self.states = [_EMPTY, _after(_EMPTY, stamp, write), _EMPTY]
                return []
            # The common case: one run that is exactly one segment already (an access like an earlier one).
            i = bisect.bisect_right(starts, start) - 1
            if starts[i] == start and i + 1 < len(starts) and starts[i + 1] == end:
                state = self.states[i]
                found_one: list[tuple[OpStamp, str, int, int]] = []
                prior = state.last_write
                if prior is not None and _unordered(prior, stamp):
                    found_one.append((prior, "writes", start, end))
                if write:
                    found_one.extend((read, "reads", start, end) for read in state.reads if _unordered(read, stamp))
                self.states[i] = _after(state, stamp, write)
                return found_one
        found: dict[int, tuple[OpStamp, str, int, int]] = {}
        memo: dict[int, tuple[_State, _State]] = {}  # id(old state) -> (old, new): old kept alive, ids stay unique
        interned: dict[tuple, _State] = {}  # equal new states as one object, so that segments merge again
        for start, end in (WHOLE,) if ranges is None else ranges:
            if start < end:
                self._access_run(start, end, stamp, write, found, memo, interned)
        return list(found.values()) if found else []

    def _access_run(self, start: int, end: int, stamp: OpStamp, write: bool,
                    found: dict[int, tuple[OpStamp, str, int, int]], memo: dict[int, tuple[_State, _State]],
                    interned: dict[tuple, _State]) -> None:
        """:meth:`access` for one run ``[start, end)``: its segments are replaced at once (split at the
        run's edges, one new segment per distinct new state), then merged with their neighbours."""
        starts, states = self.starts, self.states
        count = len(starts)
        first = bisect.bisect_right(starts, start) - 1
        stop = bisect.bisect_left(starts, end, first + 1)  # the segments first..stop-1 meet the run
        new_starts: list[int] = []
        new_states: list[_State] = []
        if starts[first] < start:  # the first segment's part before the run keeps its state
            new_starts.append(starts[first])
            new_states.append(states[first])
        for i in range(first, stop):
            state = states[i]
            lo = start if i == first else starts[i]
            hi = starts[i + 1] if i + 1 < stop else end
            prior = state.last_write
            if prior is not None and id(prior) not in found and _unordered(prior, stamp):
                found[id(prior)] = (prior, "writes", lo, hi)
            if write:
                for read in state.reads:
                    if id(read) not in found and _unordered(read, stamp):
                        found[id(read)] = (read, "reads", lo, hi)
            entry = memo.get(id(state))
            if entry is None:
                new = _after(state, stamp, write)
                new = interned.setdefault((id(new.last_write), tuple(map(id, new.reads))), new)
                memo[id(state)] = (state, new)
            else:
                new = entry[1]
            if not new_states or new_states[-1] is not new:
                new_starts.append(lo)
                new_states.append(new)
        if end < WHOLE[1] and (stop == count or end < starts[stop]):  # the last segment's part after the run
            new_starts.append(end)
            new_states.append(states[stop - 1])
        starts[first:stop] = new_starts
        states[first:stop] = new_states
        self._merge(first, first + len(new_starts) + 1)

    def _merge(self, lo: int, hi: int) -> None:
        """Merge neighbouring segments of ``[lo, hi)`` that share their state."""
        i = max(lo, 1)
        while i < min(hi, len(self.starts)):
            if self.states[i] is self.states[i - 1]:
                del self.starts[i]
                del self.states[i]
                hi -= 1
            else:
                i += 1

    def __len__(self) -> int:
        return len(self.starts)


def overlaps(a: Ranges, b: Ranges) -> bool:
    """Whether two sets of byte runs share a byte (None is everything)."""
    if a is None or b is None:
        return a != [] and b != []  # None is everything, but an empty list is no byte at all
    return any(s1 < e2 and s2 < e1 for s1, e1 in a for s2, e2 in b)
