"""Simulated device memory: CPU bytes that a plain torch zeroer sees as CUDA tensors.

On the simulator a zeroer's device tensors are :class:`SimCudaTensor`: wrapper tensors that report
``device='cuda:0'`` (so ``x.is_cuda``, ``x.device`` and vLLM's device checks take their GPU path)
and hold CPU memory inside. Their ``data_ptr()`` is that memory's real address, so an address
table built from ``kv.data_ptr()`` (vLLM's ``seg_addrs``) points into the simulated KV cache, and
the Triton kernel run by the interpreter writes exactly there. Host and device memory stay
apart: a host tensor moved to the device gets memory of its own, never an alias.

Allocation follows PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp) where it
matters for races, which is which address comes back and when:

* the stream rule: a block is allocated on the current stream; once its last tensor dies it may be
  handed out again at once, but only to an allocation on that same stream, whose later work is
  ordered after the old work. A block that ``record_stream`` tied to other streams is handed out
  again only once the events recorded on those streams at free time have completed (the allocator
  queries them, so the host then knows that work ran);
* the sizes: a request is rounded up to a multiple of 512 bytes (``round_size``), requests of up
  to 1 MiB come from the small pool and larger ones from the large pool, and a request takes the
  smallest free block of its stream and pool that holds it (best fit; of equal sizes the oldest,
  so a program is handed the same blocks on every run). So the 64 bytes of eight freed indices come
  back as the 160 bytes of the next batch's twenty slots, as on a GPU (SGLang #34076), where a
  size class per power of two would have kept them apart and missed the race.

CUDA splits a bigger free block and hands out its first bytes; here the whole block goes, so the
address is the same and the rest of it is not handed to a second request (a reuse at another
address inside a freed block is missed, never invented). Blocks are never merged either.

So a zeroer that allocates its device ids per call (vLLM #48399) is judged rightly, and one that
hands such a block to another stream without ``record_stream`` is caught: the block's next tenant
on the first stream races with the other stream's queued read.

Example::

    memory = SimDeviceMemory(rt)
    alloc = memory.alloc(64, rt.default_stream, "ids")     # 64 bytes on stream 'main' (a 512-byte block)
    memory.tensor(alloc, (8,), torch.int64)                 # the CPU tensor inside a SimCudaTensor
    del alloc                                               # its last tensor gone: free on 'main'
    memory.alloc(160, rt.default_stream, "slots")           # the same block, at once
"""

from __future__ import annotations

import bisect
import itertools
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from kvdevice.runtime import Event, Runtime, Stream
from racecheck.placement import Placed

SIM_DEVICE = torch.device("cuda", 0)
MIN_BLOCK_SIZE = 512  # CUDACachingAllocator's kMinBlockSize: every request is a multiple of it
SMALL_SIZE = 1 << 20  # its kSmallSize: requests up to 1 MiB come from the small pool
EMPTY = "empty"  # the pool of zero-byte allocations (CUDA gives them no block; here they take none of the others)


def round_size(nbytes: int) -> int:
    """The bytes CUDA's caching allocator reserves for a request of ``nbytes`` (its ``round_size``
    under the default configuration): a multiple of 512, at least 512."""
    return MIN_BLOCK_SIZE * max(1, -(-nbytes // MIN_BLOCK_SIZE))


def pool_of(nbytes: int) -> str:
    """The pool a request of ``nbytes`` is served from: a block of one pool never serves the other."""
    return EMPTY if nbytes == 0 else "small" if nbytes <= SMALL_SIZE else "large"


@dataclass(eq=False)
class Block:
    """Bytes of simulated device memory, reused by the allocator's stream rule."""

    id: int
    buffer: torch.Tensor  # uint8, CPU
    stream: Stream | None  # allocated on (None: adopted memory, never freed)
    name: str
    uses: set = field(default_factory=set)  # other streams (record_stream)
    waits: list[Event] = field(default_factory=list)  # events that must complete before reuse
    cache_tensor: int | None = None  # the KV cache's raw tensor index, for adopted cache memory
    generation: int = 1  # how many times the allocator has handed these bytes out
    nbytes: int = 0  # the bytes asked for (the buffer is rounded up: round_size)
    pool: str = "small"  # pool_of the first request: where the block goes back when freed

    @property
    def key(self) -> tuple:
        return ("simdev", self.id)

    @property
    def start(self) -> int:
        return self.buffer.data_ptr()

    @property
    def end(self) -> int:
        return self.buffer.data_ptr() + self.buffer.numel()


class Allocation:
    """One allocation's lifetime: every tensor over the block holds it; when the last dies, the
    block goes back to the allocator."""

    __slots__ = ("block", "__weakref__")

    def __init__(self, block: Block) -> None:
        self.block = block


class SimDeviceMemory:
    """The simulated caching allocator (see the module docstring)."""

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self._ids = itertools.count(1)
        self._free: dict[tuple[int, str], list[Block]] = {}  # (stream index, pool) -> free blocks
        self._released: list[Block] = []  # blocks whose last tensor died, not yet sorted
        self._starts: list[int] = []  # every block's [start, end), sorted, for address checks
        self._ranges: list[tuple[int, int, Block]] = []
        self._live: weakref.WeakValueDictionary[int, Allocation] = weakref.WeakValueDictionary()
        self.reused = 0

    # -- allocation ------------------------------------------------------------------------------
    def alloc(self, nbytes: int, stream: Stream, name: str) -> Allocation:
        """A block of at least ``nbytes`` on ``stream``: a freed one of its stream and pool that
        fits, else a fresh one (the module docstring)."""
        self._collect()
        pool = pool_of(nbytes)
        size = 0 if pool == EMPTY else round_size(nbytes)
        block = self._best_fit(self._free.get((stream.index, pool), []), size)
        if block is not None:
            block.waits, block.uses, block.name, block.nbytes = [], set(), name, nbytes
            block.generation += 1
            self.reused += 1
            self.rt.hb.name_resource(block.key, f"device block d{block.id} (reused for {name})")
            return self._track(block)
        buffer = torch.zeros(max(size, 1), dtype=torch.uint8)
        block = Block(next(self._ids), buffer, stream, name, nbytes=nbytes, pool=pool)
        self._add_range(block)
        self.rt.hb.name_resource(block.key, f"device block d{block.id} ({name})")
        return self._track(block)

    def _best_fit(self, free: list[Block], size: int) -> Block | None:
        """Take from ``free`` the smallest block of at least ``size`` bytes whose events have
        completed (of equal sizes the oldest), as the allocator's best fit does. Only the blocks
        that could win are queried, smallest first: the host learns of the work on the other
        streams of those it looked at, as after the allocator's own query."""
        def order(block: Block) -> tuple[int, int]:
            return block.buffer.numel(), block.id

        fitting = [b for b in free if b.buffer.numel() >= size]
        best = min((b for b in fitting if not b.waits), key=order, default=None)
        for block in sorted((b for b in fitting if b.waits), key=order):  # record_stream'd: rare
            if best is not None and order(best) < order(block):
                break
            if all(self.rt.query_event(e) for e in block.waits):
                best = block
                break
        if best is not None:
            free.remove(best)
        return best

    def adopt(self, tensor: torch.Tensor, name: str, cache_tensor: int | None = None) -> Allocation:
        """Memory the harness owns (the KV cache), seen by the zeroer as device memory; never freed."""
        storage = tensor.untyped_storage()
        raw = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
        block = Block(next(self._ids), raw, None, name, cache_tensor=cache_tensor, nbytes=storage.nbytes())
        self._add_range(block)
        self.rt.hb.name_resource(block.key, name)
        allocation = Allocation(block)
        self._live[block.id] = allocation
        return allocation

    def _track(self, block: Block) -> Allocation:
        allocation = Allocation(block)
        weakref.finalize(allocation, self._released.append, block)  # only a list append: safe in any GC
        self._live[block.id] = allocation
        return allocation

    def allocation_of(self, block: Block) -> Allocation | None:
        """The live allocation of ``block`` (``t.set_(storage)`` joins it), None once it was freed."""
        return self._live.get(block.id)

    def record_stream(self, allocation: Allocation, stream: Stream) -> None:
        """``tensor.record_stream(stream)``: the block is in use on ``stream`` too."""
        block = allocation.block
        if block.stream is not None and stream is not block.stream:
            block.uses.add(stream)

    def _collect(self) -> None:
        """Sort the blocks released since the last allocation into the free lists."""
        while self._released:
            block = self._released.pop()
            # PyTorch records an event on every recorded stream when the block is freed; these
            # are recorded a little later (at the next allocation), which only delays reuse.
            block.waits = [self.rt.record_event(stream=s) for s in block.uses]
            self._free.setdefault((block.stream.index, block.pool), []).append(block)

    # -- tensors ---------------------------------------------------------------------------------
    def tensor(self, allocation: Allocation, size: tuple[int, ...], dtype: torch.dtype,
               stride: tuple[int, ...] | None = None, offset: int = 0) -> torch.Tensor:
        """A CPU tensor over ``allocation``'s bytes (the inside of a SimCudaTensor)."""
        raw = allocation.block.buffer
        typed = raw[: raw.numel() // dtype.itemsize * dtype.itemsize].view(dtype)
        if stride is None:
            stride = torch.empty(size, device="meta").stride() if size else ()
        return typed.as_strided(size, stride, offset)

    # -- addresses -------------------------------------------------------------------------------
    def _add_range(self, block: Block) -> None:
        i = bisect.bisect(self._starts, block.start)
        self._starts.insert(i, block.start)
        self._ranges.insert(i, (block.start, block.end, block))

    def block_at(self, address: int) -> Block | None:
        """The block whose bytes contain ``address``, if any."""
        i = bisect.bisect(self._starts, address) - 1
        if i >= 0:
            start, end, block = self._ranges[i]
            if start <= address < end:
                return block
        return None

    def holding(self, start: int, end: int) -> Placed | None:
        """The block holding ``start``, the KV cache's apart (:class:`racecheck.placement.Memories`)."""
        block = self.block_at(start)
        kind = "device" if block is None or block.cache_tensor is None else "cache"
        return None if block is None else Placed(block, block.key, kind, [(start, min(end, block.end))])

    def ranges(self) -> list[tuple[int, int, Any]]:
        return list(self._ranges)
