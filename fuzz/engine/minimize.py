"""Take a finding's trace on to a locally minimal one: no op, chunk of ops or argument can be dropped.

Hypothesis shrinks the choices that generated a program; what it hands back can still hold an op
whose removal keeps the bug (a ``reallocate`` that only drained the device, a ``delay`` nobody
waits on), because removing it changes the choices after it. And on the simulator, and on cuda
where the simulator can show the finding, Hypothesis does not shrink at all
(:mod:`fuzz.engine.shrink`): :func:`minimize` takes the first failing program, as generated, all
the way down on the simulator, in tens of replays where Hypothesis's shrinking took hundreds. It
works on the ops themselves, with block ids made symbolic (:mod:`fuzz.engine.handles`), so that dropping an allocation drops what used its blocks and the
rest still replays, and keeps every change after which the same kind of finding still shows:

1. cut the trace after the shortest prefix that shows it (a hazard stops the program at its op);
2. drop chunks of ops, halves first, then quarters, down to single ops (never the ``start`` op);
3. set each argument back to its default or make it smaller; an allocation shrinks to the blocks
   later ops use, or to one, or merges with the allocation right after it (one zero call fewer),
   or with the allocation before it, moved up to join it (``allocate, store, allocate`` becomes
   ``allocate(n=2), store``); a ``sync_device`` right before a ``poll`` becomes ``poll(sync=1)``,
   an offloader's ``wait`` (a wait, then a poll) the ``poll`` alone, and a ``load``, ``wait`` or
   ``evict`` takes the slot of an earlier store (so that the store it named can go);

and repeats until a round changes nothing. On the simulator and in the controlled cuda mode a
replay is exact (the schedule is in the ops), so the result is deterministic.

Two bounds: :data:`MAX_REPLAYS`, and ``deadline`` (a ``time.monotonic()`` value). Cut off by the
deadline, it returns the smallest trace so far and says so (:attr:`Minimized.cut_off`); every trace
it keeps showed the same kind of finding when it was replayed, so a cut-off result is still that
finding, only not as small as it could be.

Example::

    minimized = minimize(violation, deadline=time.monotonic() + 60)   # e.g. 24 ops -> 3: start, allocate, allocate
    minimized.violation.trace, minimized.replays, minimized.cut_off
"""

from __future__ import annotations

import bisect
import json
import time
from dataclasses import dataclass, replace

from fuzz.engine.cache_pool import CachePool
from fuzz.engine.episode import EpisodeConfig, run_ops
from fuzz.engine.handles import Ref, compact, concrete, merge, symbolic
from fuzz.engine.harness_error import HarnessError
from fuzz.engine.ops import FIELDS
from fuzz.engine.oracle import Finding
from fuzz.engine.violation import ZeroerViolation
from zeroer.cache.geometries import geometry

# A bound on the work besides the clock: first failing programs of up to 24 ops took 9 to 41
# replays on the simulator (the engine-style races of examples/engine_zeroers.py, docs/fuzzing.md).
MAX_REPLAYS = 1000
_POOL = CachePool()


@dataclass
class Minimized:
    """What :func:`minimize` made of a finding."""

    violation: ZeroerViolation  # the smallest trace that showed the same kind of finding, with its findings
    replays: int  # candidate programs it ran
    cut_off: bool = False  # the deadline stopped it before a round changed nothing


def _shows(config: EpisodeConfig, ops: list[dict], kind: str) -> list[Finding] | None:
    try:
        findings = run_ops(config, ops, caches=_POOL if config.backend == "sim" else None)
    # No longer a valid program (an op on a block nothing allocated: ValueError), or one the harness
    # cannot run: it shows nothing, so the larger one is kept.
    except (ValueError, HarnessError):
        return None
    return findings if findings and findings[0].kind == kind else None


def _smaller(op: dict) -> list[dict]:
    """Variants of ``op`` with one argument dropped to its default or made smaller."""
    defaults = FIELDS[op["op"]][1]
    variants = []
    for field, value in op.items():
        if field == "op":
            continue
        if field in defaults and value != defaults[field]:
            variants.append({k: v for k, v in op.items() if k != field})  # back to its default
        if isinstance(value, int) and field in ("n", "ops", "amount", "in_flight") and value > 1:
            variants.append({**op, field: 1})
    return variants


class _Stop(Exception):
    """The deadline or the replay cap: keep the smallest trace so far."""


class _Search:
    """The smallest trace so far, and the replays that try to make it smaller."""

    def __init__(self, violation: ZeroerViolation, deadline: float | None) -> None:
        self.config = violation.config
        self.kind = violation.findings[0].kind
        self.num_blocks = geometry(self.config.geometry).num_blocks
        self.refs: list[Ref] = symbolic(violation.trace, self.num_blocks)
        self.ops: list[dict] = list(violation.trace)
        self.findings = violation.findings
        self.deadline = deadline
        self.replays = 0
        self.cut_off = False
        self._tried: set[str] = set()

    def attempt(self, refs: list[Ref]) -> bool:
        """Keep ``refs`` if its program shows the same kind of finding."""
        ops = concrete(refs, self.num_blocks)
        if ops is None:
            return False
        if ops == self.ops:  # only ops that were left out anyway went: the same program, no replay
            if len(refs) < len(self.refs):
                self.refs = refs
                return True
            return False
        key = json.dumps(ops, sort_keys=True)
        if key in self._tried:
            return False
        if self.deadline is not None and time.monotonic() >= self.deadline:
            self.cut_off = True
            raise _Stop
        if self.replays >= MAX_REPLAYS:
            raise _Stop
        self._tried.add(key)
        self.replays += 1
        found = _shows(self.config, ops, self.kind)
        if found is None:
            return False
        self.refs, self.ops, self.findings = refs, ops, found
        return True

    def truncate(self) -> None:
        """Binary search for the shortest prefix that shows it (exact for a hazard, which stops
        the program at its op; for a value finding every kept prefix was replayed anyway)."""
        base = self.refs  # bisect asks for the prefixes of 1 .. len - 1 ops in a binary search's order
        bisect.bisect_left(range(1, len(base)), True, key=lambda end: self.attempt(base[:end]))

    def drop_chunks(self) -> None:
        size = max(1, (len(self.refs) - 1) // 2)
        while size >= 1:
            start = len(self.refs) - size
            while start >= 1:  # never the start op
                self.attempt(self.refs[:start] + self.refs[start + size:])
                start -= size
            size //= 2

    def smaller_arguments(self) -> None:
        index = 0
        while index < len(self.refs):  # a merge makes the list shorter
            ref = self.refs[index]
            variants = [compact(self.refs, index), merge(self.refs, index), self._joined(index)] if ref.allocation is not None else []
            variants += [self.refs[:index] + [replace(ref, op=op)] + self.refs[index + 1:] for op in _smaller(ref.op)]
            variants += [self._fused(index), self._poll_only(index), *self._retargeted(index)]
            for variant in filter(None, variants):
                if self.attempt(variant):
                    break
            index += 1


    def _fused(self, index: int) -> list[Ref] | None:
        """``sync_device`` at ``index`` and the ``poll`` right after it as one ``poll(sync=1)`` (which
        waits for the whole device before it polls); None where they are not such a pair."""
        if self.refs[index].op.get("op") != "sync_device" or index + 1 >= len(self.refs):
            return None
        after = self.refs[index + 1]
        if after.op.get("op") != "poll":
            return None
        return self.refs[:index] + [replace(after, op={**after.op, "sync": 1})] + self.refs[index + 2:]

    def _poll_only(self, index: int) -> list[Ref] | None:
        """An offloader's ``wait`` at ``index`` (wait for a store, then poll) as the plain ``poll`` it
        ends with; None where it is not a ``wait``. Without it a job reported early stayed at
        ``store, store, wait`` where ``store, poll`` shows it (Hypothesis's shrinking, which chose
        the ops, reached the shorter one)."""
        if self.refs[index].op.get("op") != "wait":
            return None
        return self.refs[:index] + [replace(self.refs[index], op={"op": "poll"}, slot=None)] + self.refs[index + 1:]

    def _retargeted(self, index: int) -> list[list[Ref]]:
        """A ``load``, ``wait`` or ``evict`` at ``index`` moved to the slot of an earlier store (the
        earliest first; never a later one, or two ops could trade slots for ever), so that the store
        it named can go in the next round. Without it SGLang #36738's race stayed at ``store, store,
        wait(1), free, load(2)``: the load named the second store's slot, the first would do too."""
        ref = self.refs[index]
        if ref.slot is None:
            return []
        return [self.refs[:index] + [replace(ref, slot=earlier.store)] + self.refs[index + 1:]
                for earlier in self.refs[:index] if earlier.store is not None and earlier.store < ref.slot]

    def _joined(self, index: int) -> list[Ref] | None:
        """The allocation at ``index`` moved up to right after the allocation before it and merged
        with it; None when there is none to join (or they are adjacent: ``merge`` tries that)."""
        if self.refs[index].op.get("op") != "allocate":
            return None
        previous = next((j for j in range(index - 1, 0, -1) if self.refs[j].op.get("op") == "allocate"), None)
        if previous is None or previous == index - 1:
            return None
        moved = self.refs[:previous + 1] + [self.refs[index]] + self.refs[previous + 1:index] + self.refs[index + 1:]
        return merge(moved, previous)


def minimize(violation: ZeroerViolation, *, deadline: float | None = None) -> Minimized:
    """A locally minimal version of ``violation``'s trace showing the same kind of finding, replayed
    on ``violation.config``; past ``deadline`` (``time.monotonic()``) the smallest one so far."""
    if not violation.findings:
        return Minimized(violation, 0)
    search = _Search(violation, deadline)
    try:
        while True:
            before = (search.ops, len(search.refs))
            search.truncate()
            search.drop_chunks()
            search.smaller_arguments()
            if (search.ops, len(search.refs)) == before:
                break
    except _Stop:
        pass
    if search.ops == violation.trace:
        return Minimized(violation, search.replays, search.cut_off)
    return Minimized(ZeroerViolation(search.findings, search.ops, violation.config), search.replays, search.cut_off)
