"""An intercepted zeroer's (or program's) pinned host memory, named for the reports.

What is watched and why is :mod:`racecheck.pinned`'s (:class:`~racecheck.pinned.PinnedWatch`): the
pinned regions the code allocates or registers with ``cudaHostRegister``, a snapshot of the bytes
each queued read will see, compared at every boundary the harness sees (every intercepted torch
call, stream or event call, kernel launch, and the start and end of every call), the queued
device-to-host copies that write pinned memory, and the host accesses a call shows. This module
adds what the fuzz harness's reports say: ``pinned host buffer p3 of the zeroer
(torch.empty(pin_memory=True))``, with the zeroer's name once several share a runtime.

Example::

    pinned = HostMemory(rt)
    buf = pinned.register(torch.empty(8, dtype=torch.int64))
    stamp = rt.launch(copy, ...)                   # the queued copy that reads buf[:2]
    pinned.note_read(buf, view=buf.base[:2], stamp=stamp)
    buf.base.numpy()[0] = 7                        # no torch op: only the snapshot sees it
    pinned.check("zero_block_ids#2, before copy_ #5")   # -> a host-write-vs-pending-copy hazard
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._mode_utils import no_dispatch

from racecheck.pinned import PinnedWatch, Region
from kvdevice.intercept.sim_graphs import CapturedOp
from kvdevice.intercept.sim_host_allocator import SimHostAllocator
from kvdevice.runtime import Runtime

PinnedBuffer = Region  # one pinned allocation of the code under test (views share it)


class HostMemory(PinnedWatch):
    """The pinned regions of one session and the reads still pending on them.

    With ``caching`` (a program on the simulator), pinned memory made by torch comes from
    :class:`~kvdevice.intercept.sim_host_allocator.SimHostAllocator`, freed when its tensors die and
    handed out again as torch's caching host allocator does; a block handed out again is a host
    write of the bytes its last tenant had (``on_reuse``: the session reports it at the program's line).
    """

    caching = False

    def __init__(self, runtime: Runtime, ids: Iterator[int] | None = None, owner: str = "the zeroer") -> None:
        super().__init__(runtime.hb, runtime.host_thread, ids)  # ids per runtime (kvdevice.intercept.shared)
        self.rt = runtime
        self._owner = owner
        self.allocator = SimHostAllocator(runtime) if self.caching else None
        self.on_reuse: Callable[[torch.Tensor, str], None] | None = None

    def pin(self, tensor: torch.Tensor, origin: str) -> torch.Tensor:
        """``tensor`` (a fresh CPU tensor) as pinned memory torch allocated: itself, registered, or
        with ``caching`` a tensor with its values over a block of the allocator."""
        if self.allocator is None:
            self.register(tensor, origin)
            return tensor
        pinned, _block, reused = self.allocator.allocate(tensor)
        if reused and self.on_reuse is not None and self.lookup(pinned) is not None:
            self.on_reuse(pinned, origin)  # before the new tenant's bytes land, against the old one's copies
        with torch._C.DisableTorchFunction(), no_dispatch():
            pinned.copy_(tensor)
        layout = f"{tuple(tensor.shape)} {str(tensor.dtype).replace('torch.', '')}"
        self.register(pinned, origin, keep=False, layout=layout)
        return pinned

    def by_address(self, tensor: torch.Tensor) -> torch.Tensor:
        """What queued device work keeps of ``tensor``: its address. A view of the same bytes over the
        allocator's block, so the work does not keep the tensor alive (on CUDA a queued copy or
        kernel holds no reference: the tensor can die and its block be handed out again first)."""
        block = self.allocator.block_of(tensor) if self.allocator is not None else None
        if block is None:
            return tensor
        with torch._C.DisableTorchFunction(), no_dispatch():
            return torch.empty(0, dtype=tensor.dtype).set_(block.buffer.untyped_storage(), tensor.storage_offset(),
                                                          tensor.size(), tensor.stride())

    def used_by_copy(self, tensor: torch.Tensor, stream: Any) -> None:
        """A non-blocking copy on ``stream`` read or wrote ``tensor``: the allocator's ``record_event``."""
        if self.allocator is not None:
            self.allocator.used_by(tensor, stream)

    def register(self, tensor: torch.Tensor, origin: str = "", site: Any = None, **details: Any) -> Region:
        """Remember ``tensor`` (a CPU tensor) as pinned memory the code allocated."""
        region = super().register(tensor, origin=origin, site=site, **details)
        self._name(region)
        return region

    def register_range(self, start: int, nbytes: int, origin: str = "", site: Any = None, **details: Any) -> Region:
        region = super().register_range(start, nbytes, origin=origin, site=site, **details)
        self._name(region)
        return region

    def _name(self, region: Region) -> None:
        origin = f" ({region.origin})" if region.origin else ""
        self.rename(region, f"pinned host buffer p{region.id} of {self._owner}{origin}")

    def rename_owner(self, owner: str) -> None:
        """Name every region as ``owner``'s (``zeroer 0`` once a second zeroer shares the runtime)."""
        self._owner = owner
        for region in self.regions.regions():
            self._name(region)

    def note_read(self, region: Region, view: torch.Tensor, stamp: Any, keep: Any = None) -> Any:
        if isinstance(stamp, CapturedOp):  # recorded by a CUDA graph capture: checked at each replay
            stamp.pinned_reads.append((region, view))
            return None
        return super().note_read(region, view, stamp, keep)

    def note_device_write(self, region: Region, view: torch.Tensor, stamp: Any) -> list[tuple[int, int]]:
        if isinstance(stamp, CapturedOp):
            stamp.pinned_writes.append((region, view))
            return []
        return super().note_device_write(region, view, stamp)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return self.lookup(tensor) is not None

    def buffers(self) -> list[Region]:
        return self.regions.regions()


class CachingHostMemory(HostMemory):
    """An offloader's pinned memory on the simulator: torch's caching host allocator modelled, so a
    temporary dropped under a kernel that reads it through its address is handed to the next
    ``pin_memory()`` (LMCache #4830), as on a GPU."""

    caching = True
