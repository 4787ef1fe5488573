"""The integers the host staged into device memory: a table or an index a device op goes through.

vLLM's CPU offloading handler builds tables of raw addresses on the host (``data_ptr()`` plus a
block id times a row stride, in numpy), moves them to the GPU with
``torch.from_numpy(table).to("cuda", non_blocking=True)`` and launches a Triton kernel that loads
its source and destination pointers from them; its offload worker gathers blocks with
``index_select`` over block ids sent the same way. What such an op touches is in those values. On a
GPU a tool knows them only from their host source: a host-to-device copy of small integer data
made while the tool runs records the values it delivers; a later copy over part of them, or any
device write to that memory, forgets them (the op then cannot be followed from them, and each tool
says so or waits to read them back: never a guess). The fuzzer's CUDA backend
(:mod:`zeroer.intercept.cuda_ops`) and the sanitizer's GPU observer (:mod:`sanitizer.gpu.indices`)
both keep theirs here.

Example::

    staged = StagedValues()
    staged.record(device_table, host_table)        # after the copy is queued
    staged.values(device_table)                    # -> the host table's values, as numpy
    staged.written(device_table.untyped_storage().data_ptr())   # -> forgotten
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils._mode_utils import no_dispatch

from racecheck.dtypes import NUMPY_INTEGERS

MAX_STAGED = 1 << 16  # elements of a copy whose values are remembered (a table, an index; not a tensor of data)


@dataclass
class _Known:
    start: int  # the first byte on the device
    values: np.ndarray  # in the device tensor's dtype, one per element from ``start``
    dtype: torch.dtype

    @property
    def end(self) -> int:
        return self.start + self.values.size * self.values.itemsize


class StagedValues:
    """Values staged host to device, by the device storage they landed in (module docstring)."""

    def __init__(self) -> None:
        self._known: dict[int, list[_Known]] = {}  # device storage address -> what was staged there

    def record(self, device: torch.Tensor, host: torch.Tensor) -> None:
        """``host``'s values now sit in ``device`` (a host-to-device copy just queued or done)."""
        dtype = NUMPY_INTEGERS.get(device.dtype)
        if dtype is None or NUMPY_INTEGERS.get(host.dtype) is None or device.numel() > MAX_STAGED:
            return
        if device.numel() != host.numel() or not device.is_contiguous():
            return
        with torch._C.DisableTorchFunction(), no_dispatch():
            values = host.detach().reshape(-1).numpy().astype(dtype, copy=True)
        address = device.untyped_storage().data_ptr()
        known = [k for k in self._known.get(address, ()) if k.end <= device.data_ptr()
                 or device.data_ptr() + values.nbytes <= k.start]  # what the copy overwrote is gone
        known.append(_Known(device.data_ptr(), values, device.dtype))
        self._known[address] = known

    def written(self, address: int, ranges: list[tuple[int, int]] | None = None) -> None:
        """A device op writes ``ranges`` (absolute byte runs; None: all) of the storage at
        ``address``: the values staged there are stale."""
        if ranges is None:
            self._known.pop(address, None)
            return
        known = self._known.get(address)
        if known:
            self._known[address] = [k for k in known if not any(s < k.end and k.start < e for s, e in ranges)]

    def values(self, tensor: torch.Tensor) -> np.ndarray | None:
        """``tensor``'s values where the host staged them and nothing wrote them since, else None."""
        if not tensor.is_contiguous():
            return None
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        for entry in reversed(self._known.get(tensor.untyped_storage().data_ptr(), ())):
            if entry.dtype == tensor.dtype and entry.start <= start and end <= entry.end:
                first = (start - entry.start) // tensor.element_size()
                return entry.values[first:first + tensor.numel()].reshape(tuple(tensor.shape))
        return None


__all__ = ["MAX_STAGED", "StagedValues"]
