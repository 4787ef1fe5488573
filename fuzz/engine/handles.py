"""Block ids in a trace as references to the allocations that handed them out.

An op record names a block by its id (``{"op": "write", "block": 3}``), and which ids an
``allocate`` gets depends on every allocate and free before it: each cache hands out blocks from a
FIFO free queue (blocks 1..N-1; a freed block goes to the back; :class:`~fuzz.engine.episode.CacheGroup`).
Dropping an op from a trace therefore shifts the ids of every later allocation, and the ops that
named those ids then point at another block, or at one that is not live, and the program no longer
replays. The minimizer (:mod:`fuzz.engine.minimize`) works on *symbolic* ops instead:

* :func:`symbolic` rewrites each block id as a handle ``(allocation, position)``: the ``position``-th
  block of the ``allocation``-th op of the trace;
* :func:`concrete` turns symbolic ops back into op records, giving each allocation the ids the free
  queue hands out now, and leaves out every op whose handle no allocation holds any more (its
  allocation was dropped, or made smaller);
* :func:`compact` makes an allocation as small as the blocks later ops use, renumbering their
  handles; :func:`merge` makes two allocations in a row one call (the same blocks, in the same
  order, one zero call fewer).

So dropping an allocation drops everything that used its blocks, and the rest still replays. The
queue model is the episode's own rule, restated here without running anything; a mismatch would
only make a candidate fail to replay (the minimizer then keeps the larger program).

An offload campaign's ops (:mod:`fuzz.engine.offload`) are handled the same way: a ``load``
allocates one block (the queue's tail, or with ``oldest`` its head), a ``store`` takes a host slot
from the slots' own FIFO queue (slots 1..N-1), and a ``load``, ``wait`` or ``evict`` names its slot
by the store that took it, so dropping a store drops the ops on its slot. An ``evict`` frees its
slot here whatever the offloader answers: one that kept it (its ``evict`` said False) makes the
model one slot off, and a candidate after it fails to replay, as any mismatch does.

Example::

    ops = [{"op": "start"}, {"op": "allocate", "n": 1}, {"op": "allocate", "n": 1}, {"op": "write", "block": 2}]
    refs = symbolic(ops, num_blocks=8)
    concrete(refs[:1] + refs[2:], num_blocks=8)
    # [{'op': 'start'}, {'op': 'allocate', 'n': 1}, {'op': 'write', 'block': 1}]
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace

from fuzz.engine.free_queue import FreeQueue

Handle = tuple[int, int]  # (the allocation's index in the original trace, the block's position in it)


@dataclass(frozen=True)
class Ref:
    """One op with its block reference made symbolic."""

    op: dict
    allocation: int | None = None  # an allocate op: its stable id (its index in the original trace)
    handle: Handle | None = None  # an op on a block: which allocation's block, and which of them
    slot: int | None = None  # a load, wait or evict: the index of the store that took its host slot
    store: int | None = None  # a store: its stable id (its index in the original trace)


def _queues(num_blocks: int) -> defaultdict[int, FreeQueue]:
    """The free queues of an episode's caches by cache index, by the episode's rule (FIFO, blocks 1..N-1)."""
    return defaultdict(lambda: FreeQueue(num_blocks))


def symbolic(ops: list[dict], num_blocks: int) -> list[Ref]:
    """``ops`` with every block id replaced by the handle of the allocation that handed it out.

    An op whose block no allocation holds (a trace written by hand) keeps its id as it is.
    """
    queues = _queues(num_blocks)
    owner: dict[tuple[int, int], Handle] = {}  # (cache, block) -> handle, for live blocks
    slots = FreeQueue(num_blocks)  # the host pool's free slots (fuzz.engine.offload)
    slot_owner: dict[int, int] = {}  # slot -> the index of the store that took it
    refs = []
    for index, op in enumerate(ops):
        cache = op.get("cache", 0)
        if op.get("op") == "load" and op.get("slot") in slot_owner:
            free = queues[0]
            if free:
                owner[(0, free.popleft() if op.get("oldest") else free.pop())] = (index, 0)
            refs.append(Ref(op, allocation=index, slot=slot_owner[op["slot"]]))
        elif op.get("op") == "wait" and op.get("slot") in slot_owner:
            refs.append(Ref(op, slot=slot_owner[op["slot"]]))
        elif op.get("op") == "evict" and op.get("slot") in slot_owner:
            refs.append(Ref(op, slot=slot_owner.pop(op["slot"])))
            slots.append(op["slot"])
        elif op.get("op") == "store" and (0, op.get("block")) in owner and slots:
            slot_owner[slots.popleft()] = index
            refs.append(Ref(op, handle=owner[(0, op["block"])], store=index))
        elif op.get("op") == "allocate":
            free = queues[cache]
            n = op.get("n")
            if isinstance(n, int) and 0 < n <= len(free):
                for position in range(n):
                    owner[(cache, free.popleft())] = (index, position)
            refs.append(Ref(op, allocation=index))
        elif "block" in op and (cache, op["block"]) in owner:
            handle = owner[(cache, op["block"])]
            if op["op"] == "free":
                del owner[(cache, op["block"])]
                queues[cache].append(op["block"])
            refs.append(Ref(op, handle=handle))
        else:
            refs.append(Ref(op))
    return refs


def concrete(refs: list[Ref], num_blocks: int) -> list[dict] | None:
    """Op records for ``refs``: each allocation takes the ids its cache's queue hands out now, and
    an op on a block that no kept allocation holds is left out. None: an allocation asks for more
    blocks than are free (not a valid program)."""
    queues = _queues(num_blocks)
    placed: dict[Handle, tuple[int, int]] = {}  # handle -> (cache, block)
    slots = FreeQueue(num_blocks)
    placed_slots: dict[int, int] = {}  # the index of a kept store -> the slot it takes now
    ops = []
    for ref in refs:
        op = ref.op
        if op.get("op") in ("load", "evict", "wait") and ref.slot is not None:
            slot = placed_slots.get(ref.slot)
            if slot is None:  # its store was dropped: so is this op (and, for a load, its block)
                continue
            if op["op"] == "evict":
                del placed_slots[ref.slot]
                slots.append(slot)
            elif op["op"] == "load":
                free = queues[0]
                if not free:
                    return None
                placed[(ref.allocation, 0)] = (0, free.popleft() if op.get("oldest") else free.pop())
            ops.append({**op, "slot": slot})
            continue
        if ref.store is not None:
            if ref.handle not in placed or not slots:
                continue
            placed_slots[ref.store] = slots.popleft()
        if ref.allocation is not None:
            cache = op.get("cache", 0)
            free = queues[cache]
            if op["n"] > len(free):
                return None
            for position in range(op["n"]):
                placed[(ref.allocation, position)] = (cache, free.popleft())
            ops.append(op)
        elif ref.handle is not None:
            where = placed.get(ref.handle)
            if where is None:  # its allocation was dropped or made smaller: so is this op
                continue
            if op["op"] == "free":
                del placed[ref.handle]
                queues[where[0]].append(where[1])
            placed_op = {k: v for k, v in op.items() if k != "cache"}
            placed_op["block"] = where[1]
            if where[0]:  # the block's cache is its allocation's (which may have moved to cache 0)
                placed_op["cache"] = where[0]
            ops.append(placed_op)
        else:
            ops.append(op)
    return ops


def compact(refs: list[Ref], index: int) -> list[Ref] | None:
    """``refs`` with the allocation at ``index`` cut down to the blocks later ops use (at least
    one), their handles renumbered in order; None if it already is that small."""
    allocation = refs[index].allocation
    if allocation is None or refs[index].op.get("op") != "allocate":
        return None
    used = sorted({r.handle[1] for r in refs if r.handle is not None and r.handle[0] == allocation})
    n = max(1, len(used))
    if n >= refs[index].op["n"]:
        return None
    renumber = {old: new for new, old in enumerate(used)}
    out = []
    for i, ref in enumerate(refs):
        if i == index:
            out.append(replace(ref, op={**ref.op, "n": n}))
        elif ref.handle is not None and ref.handle[0] == allocation:
            out.append(replace(ref, handle=(allocation, renumber[ref.handle[1]])))
        else:
            out.append(ref)
    return out


def merge(refs: list[Ref], index: int) -> list[Ref] | None:
    """``refs`` with the allocation at ``index`` and the one right after it made one call, with the
    first one's arguments; None unless both are allocations from the same cache. The queue hands the
    merged call the same blocks in the same order, so every handle keeps its block."""
    if index + 1 >= len(refs):
        return None
    first, second = refs[index], refs[index + 1]
    if first.allocation is None or second.allocation is None or first.op.get("cache", 0) != second.op.get("cache", 0):
        return None
    if first.op.get("op") != "allocate" or second.op.get("op") != "allocate":
        return None
    offset = first.op["n"]
    out = []
    for i, ref in enumerate(refs):
        if i == index:
            out.append(replace(ref, op={**ref.op, "n": offset + second.op["n"]}))
        elif i == index + 1:
            continue
        elif ref.handle is not None and ref.handle[0] == second.allocation:
            out.append(replace(ref, handle=(first.allocation, offset + ref.handle[1])))
        else:
            out.append(ref)
    return out
