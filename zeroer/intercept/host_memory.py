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

from collections.abc import Iterator
from typing import Any

import torch

from racecheck.pinned import PinnedWatch, Region
from zeroer.intercept.sim_graphs import CapturedOp
from zeroer.runtime import Runtime

PinnedBuffer = Region  # one pinned allocation of the code under test (views share it)


class HostMemory(PinnedWatch):
    """The pinned regions of one session and the reads still pending on them."""

    def __init__(self, runtime: Runtime, ids: Iterator[int] | None = None, owner: str = "the zeroer") -> None:
        super().__init__(runtime.hb, runtime.host_thread, ids)  # ids per runtime (zeroer.intercept.shared)
        self.rt = runtime
        self._owner = owner

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
