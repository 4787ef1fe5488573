"""torch's caching host allocator on the simulator: pinned memory is freed and handed out again.

On CUDA, ``torch.empty(..., pin_memory=True)``, ``x.pin_memory()`` and the pinned result of a
non-blocking ``.to("cpu")`` come from ``CachingHostAllocator`` (aten/src/ATen/core/CachingHostAllocator.h,
the same in torch 2.11 and 2.13). What this module keeps of it, because races depend on it:

* a request is rounded up to a power of two and served from that size's free list, last freed
  first (``get_free_block`` takes the back), so the next temporary of the same size gets the bytes
  of the one just freed;
* a block is freed when the last tensor or storage over it dies; it goes straight to the free list
  unless some stream used it, in which case an event is recorded on each such stream and the block
  waits until all have completed (``free``; the next allocation queries them, ``process_events``);
* the only uses it learns of are non-blocking copies: ``copy_`` between a pinned tensor and the
  device calls ``record_event`` on the host side's block, either direction
  (aten/src/ATen/native/cuda/Copy.cu). ``record_stream`` has no CPU kernel (its only dispatch
  is CUDA), so it cannot protect a pinned tensor; a kernel (Triton, a C++ op through raw pointers),
  a CUDA graph replay or an access through another tensor over ``data_ptr()`` is not seen.

So a temporary whose only device use is a non-blocking copy is safe to drop on return, and one read
by a kernel through its pointer is handed to the next caller while the kernel may still be queued
(LMCache #4830). The allocator queries events as CUDA does, so the host then knows that work ran.

Example::

    allocator = SimHostAllocator(rt)
    tensor, block, reused = allocator.allocate(torch.arange(4.0))   # pinned, values copied
    allocator.used_by(tensor, rt.current_stream())                  # a non-blocking copy_ used it
    del tensor                                                      # freed; reused once its event completes
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._mode_utils import no_dispatch

from kvdevice.runtime import Event, Runtime, Stream
from kvdevice.runtime.host_memory import size_class  # c10::llvm::PowerOf2Ceil


@dataclass(eq=False)
class HostBlock:
    """One pinned block; the allocator keeps its bytes for good, as torch's cache does."""

    buffer: torch.Tensor  # uint8, CPU
    streams: set[Stream] = field(default_factory=set)  # record_event since it was handed out
    events: list[Event] = field(default_factory=list)  # recorded at free: all must complete first
    tenants: int = 0  # how many times it was handed out

    @property
    def start(self) -> int:
        return self.buffer.data_ptr()


class SimHostAllocator:
    """See the module docstring."""

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self._blocks: dict[int, HostBlock] = {}  # by start address
        self._free: dict[int, list[HostBlock]] = {}  # size -> blocks, the last freed at the back
        self._waiting: list[HostBlock] = []  # freed with events not yet complete
        self._died: list[HostBlock] = []  # freed since the last allocation (a list append: safe in any GC)

    def allocate(self, like: torch.Tensor) -> tuple[torch.Tensor, HostBlock, bool]:
        """A pinned tensor with ``like``'s shape, strides and dtype over a block (its values are not
        written: the caller writes them once it has checked the reuse); whether the block was used before."""
        self._collect()
        with torch._C.DisableTorchFunction(), no_dispatch():
            nbytes = like.untyped_storage().nbytes()
            size = size_class(max(nbytes, 1))
            free = self._free.get(size)
            block = free.pop() if free else self._new(size)
            block.tenants += 1
            # The tensor's own storage wraps an array whose death is the free: torch.from_numpy's
            # storage holds the array until the last tensor and storage over it are gone.
            holder = block.buffer.numpy()[:nbytes].view()
            weakref.finalize(holder, self._died.append, block)
            raw = torch.from_numpy(holder)
            tensor = torch.empty(0, dtype=like.dtype).set_(raw.untyped_storage(), like.storage_offset(),
                                                          like.size(), like.stride())
        return tensor, block, block.tenants > 1

    def block_of(self, tensor: torch.Tensor) -> HostBlock | None:
        """The block ``tensor`` (a CPU tensor) lives in, if the allocator made it."""
        with torch._C.DisableTorchFunction():
            return self._blocks.get(tensor.untyped_storage().data_ptr())

    def used_by(self, tensor: torch.Tensor, stream: Stream) -> None:
        """``record_event``: a non-blocking copy on ``stream`` used ``tensor``'s block."""
        block = self.block_of(tensor)
        if block is not None:
            block.streams.add(stream)

    def _new(self, size: int) -> HostBlock:
        block = HostBlock(torch.zeros(size, dtype=torch.uint8))
        self._blocks[block.start] = block
        return block

    def _collect(self) -> None:
        """``free`` for the blocks whose tenant died, then ``process_events`` for those waiting."""
        while self._died:
            block = self._died.pop(0)
            if block.streams:
                # torch records these at the free; here at the next allocation, which only delays reuse.
                block.events = [self.rt.record_event(stream=stream) for stream in block.streams]
                block.streams = set()
                self._waiting.append(block)
            else:
                self._free.setdefault(block.buffer.numel(), []).append(block)
        still: list[HostBlock] = []
        for block in self._waiting:
            if all(self.rt.query_event(event) for event in block.events):  # the host then knows they ran
                block.events = []
                self._free.setdefault(block.buffer.numel(), []).append(block)
            else:
                still.append(block)
        self._waiting = still

    def describe(self) -> dict[str, Any]:
        return {"blocks": len(self._blocks), "waiting": len(self._waiting),
                "free": sum(len(v) for v in self._free.values())}
