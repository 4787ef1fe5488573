"""The zeroer's pinned host buffers, and the host writes to them that no torch op sees.

A non-blocking copy (or a kernel) reads pinned memory when its stream reaches it, so the host
rewriting that memory before then changes what arrives (vLLM #48085). A plain torch zeroer writes
its pinned staging through a numpy view (``buf.numpy()[:n] = ids``), ``ctypes.memmove`` or a torch
op; only the last is a call the harness sees. So every pinned buffer the zeroer allocates is
registered here, and every queued read of one is remembered with a snapshot of the bytes it will
read. At each boundary the harness does see (every intercepted torch call, stream or event call,
kernel launch, and the start and end of every zeroer call), the bytes of every read the host has
not yet seen complete are compared with their snapshot; a difference is a host write under a
pending read, reported to the happens-before checker exactly as a runtime-API zeroer's
``write_host`` would be, and attributed to the code between the previous boundary and this one.

Example::

    pinned = HostMemory(rt)
    buf = pinned.register(torch.empty(8, dtype=torch.int64))
    stamp = rt.launch(copy, ...)                   # the queued copy that reads buf[:2]
    pinned.note_read(buf, view=buf.base[:2], stamp=stamp)
    buf.base.numpy()[0] = 7                        # no torch op: only the snapshot sees it
    pinned.check("zero_block_ids#2, before copy_ #5")   # -> a host-write-vs-pending-copy hazard
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from zeroer.runtime import Runtime
from racecheck.hb import OpStamp

# numpy has no bfloat16 or fp8: compare those as integers of the same width.
_AS_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bytes(view: torch.Tensor) -> bytes:
    """The bytes of the elements ``view`` covers (any strides, any dtype)."""
    if view.dtype.is_floating_point and view.dtype not in (torch.float32, torch.float64, torch.float16):
        view = view.view(_AS_INT[view.element_size()])
    return view.detach().numpy().tobytes()


@dataclass(eq=False)
class PinnedBuffer:
    """One pinned allocation of the zeroer's (the whole tensor it got, views share it)."""

    id: int
    base: torch.Tensor
    name: str
    origin: str = ""  # the call that made it: torch.empty(pin_memory=True), Tensor.pin_memory()

    @property
    def key(self) -> tuple:
        return ("pinned", self.id)


@dataclass(eq=False)
class _PendingRead:
    buffer: PinnedBuffer
    view: torch.Tensor
    snapshot: bytes
    stamp: OpStamp


class HostMemory:
    """The pinned buffers of one intercepted zeroer and the reads still pending on them."""

    def __init__(self, runtime: Runtime, ids: Iterator[int] | None = None, owner: str = "the zeroer") -> None:
        self.rt = runtime
        self._ids = ids if ids is not None else itertools.count(1)  # per runtime (zeroer.intercept.shared)
        self._owner = owner
        self._by_storage: dict[int, PinnedBuffer] = {}  # storage data_ptr -> buffer
        self._pending: list[_PendingRead] = []
        self.device_written: set[int] = set()  # buffers a device-to-host copy writes: not diffed

    def register(self, tensor: torch.Tensor, origin: str = "") -> PinnedBuffer:
        """Remember ``tensor`` (a CPU tensor) as pinned memory the zeroer allocated."""
        buffer = PinnedBuffer(next(self._ids), tensor, "", origin)
        self._by_storage[tensor.untyped_storage().data_ptr()] = buffer
        self._name(buffer)
        return buffer

    def _name(self, buffer: PinnedBuffer) -> None:
        origin = f" ({buffer.origin})" if buffer.origin else ""
        buffer.name = f"pinned host buffer p{buffer.id} of {self._owner}{origin}"
        self.rt.hb.name_resource(buffer.key, buffer.name)

    def rename_owner(self, owner: str) -> None:
        """Name every buffer as ``owner``'s (``zeroer 0`` once a second zeroer shares the runtime)."""
        self._owner = owner
        for buffer in self._by_storage.values():
            self._name(buffer)

    def lookup(self, tensor: torch.Tensor) -> PinnedBuffer | None:
        """The pinned buffer ``tensor`` (a CPU tensor, maybe a view) lives in, if any."""
        if tensor.device.type != "cpu":
            return None
        return self._by_storage.get(tensor.untyped_storage().data_ptr())

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return self.lookup(tensor) is not None

    def buffers(self) -> list[PinnedBuffer]:
        return list(self._by_storage.values())

    def note_read(self, buffer: PinnedBuffer, view: torch.Tensor, stamp: OpStamp) -> None:
        """A queued op (``stamp``) reads ``view`` of ``buffer`` when its stream reaches it."""
        self.rt.hb.copy_reads_host(buffer.key, stamp)
        if buffer.id not in self.device_written:
            self._pending.append(_PendingRead(buffer, view, _bytes(view), stamp))

    def note_device_write(self, buffer: PinnedBuffer) -> None:
        """A queued device-to-host copy writes ``buffer``: its bytes change without a host write."""
        self.device_written.add(buffer.id)
        self._pending = [p for p in self._pending if p.buffer is not buffer]

    def check(self, where: str) -> None:
        """Compare every pending read's bytes with its snapshot; report host writes at ``where``."""
        if not self._pending:
            return
        hb = self.rt.hb
        still: list[_PendingRead] = []
        written: set[int] = set()
        for read in self._pending:
            if read.buffer.id in written or hb.host_has_seen(read.stamp):
                continue  # reported already, or the host knows the read is done
            if _bytes(read.view) != read.snapshot:
                hb.host_write(read.buffer.key, where)  # flags every read of it the host has not seen
                written.add(read.buffer.id)
                continue
            still.append(read)
        self._pending = [p for p in still if p.buffer.id not in written]
