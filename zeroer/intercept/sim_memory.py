"""Simulated device memory: CPU bytes that a plain torch zeroer sees as CUDA tensors.

On the simulator a zeroer's device tensors are :class:`SimCudaTensor`: wrapper tensors that report
``device='cuda:0'`` (so ``x.is_cuda``, ``x.device`` and vLLM's device checks take their GPU path)
and hold CPU memory inside. Their ``data_ptr()`` is that memory's real address, so an address
table built from ``kv.data_ptr()`` (vLLM's ``seg_addrs``) points into the simulated KV cache, and
the Triton kernel run by the interpreter writes exactly there. Host and device memory stay
apart: a host tensor moved to the device gets memory of its own, never an alias.

Allocation follows PyTorch's CUDA caching allocator where it matters for races (the stream rule):
a block is allocated on the current stream; once its last tensor dies it may be handed out again
at once, but only to an allocation on that same stream, whose later work is ordered after the old
work. A block that ``record_stream`` tied to other streams is handed out again only once the
events recorded on those streams at free time have completed (the allocator queries them, so the
host then knows that work ran). So a zeroer that allocates its device ids per call (vLLM #48399)
is judged rightly, and one that hands such a block to another stream without ``record_stream`` is
caught: the block's next tenant on the first stream races with the other stream's queued read.

Example::

    memory = SimDeviceMemory(rt)
    alloc = memory.alloc(64, rt.default_stream, "ids")     # 64 bytes on stream 'main'
    memory.tensor(alloc, (8,), torch.int64)                 # a SimCudaTensor over them
"""

from __future__ import annotations

import bisect
import itertools
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from zeroer.runtime import Event, Runtime, Stream
from zeroer.runtime.host_memory import size_class

SIM_DEVICE = torch.device("cuda", 0)


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
    nbytes: int = 0  # the bytes asked for (the buffer is rounded up to a size class)

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
        self._free: dict[tuple[int, int], list[Block]] = {}  # (stream index, size class) -> blocks
        self._released: list[Block] = []  # blocks whose last tensor died, not yet sorted
        self._starts: list[int] = []  # every block's [start, end), sorted, for address checks
        self._ranges: list[tuple[int, int, Block]] = []
        self._live: weakref.WeakValueDictionary[int, Allocation] = weakref.WeakValueDictionary()
        self.reused = 0

    # -- allocation ------------------------------------------------------------------------------
    def alloc(self, nbytes: int, stream: Stream, name: str) -> Allocation:
        """A block of at least ``nbytes`` on ``stream``."""
        self._collect()
        size = size_class(max(nbytes, 1))
        free = self._free.get((stream.index, size), [])
        # the oldest block whose events have completed (the allocator looked: the host knows)
        block = next((b for b in free if all(self.rt.query_event(e) for e in b.waits)), None)
        if block is not None:
            free.remove(block)
            block.waits, block.uses, block.name, block.nbytes = [], set(), name, nbytes
            block.generation += 1
            self.reused += 1
            self.rt.hb.name_resource(block.key, f"device block d{block.id} (reused for {name})")
            return self._track(block)
        block = Block(next(self._ids), torch.zeros(size, dtype=torch.uint8), stream, name, nbytes=nbytes)
        self._add_range(block)
        self.rt.hb.name_resource(block.key, f"device block d{block.id} ({name})")
        return self._track(block)

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
            self._free.setdefault((block.stream.index, block.buffer.numel()), []).append(block)

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

    def ranges(self) -> list[tuple[int, int, Any]]:
        return list(self._ranges)
