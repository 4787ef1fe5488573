"""The rows an indexed op touches, so that gathering some rows of a tensor on one stream while
another stream writes other rows is not taken for a race.

``index_select(kv, 0, ids)``, ``kv[ids]``, ``kv.index_copy_(0, ids, src)``, gathers, scatters and
``embedding`` touch only the rows their index tensor names (:func:`racecheck.ops.indexed_rows`).
vLLM's offload worker stores the blocks it offloads with ``index_select`` on its transfer stream
while the compute stream writes other blocks of the same KV tensor; taking the whole tensor as read
would call that a race. The index tensor lives on the device, so its values are known only:

* where the observer's shadow of device values knows them (:mod:`racecheck.device_values`): the
  program made them from the host (a copy, ``.to()``, ``torch.tensor(..., device=)``) or from
  other known values on the device (arithmetic, ``arange``, a slice), and nothing it cannot
  evaluate wrote them since (a host write under a pinned copy is a race reported on its own);
* or once the op has run and the host has seen it, while nothing has written the index since: the
  observer then reads the index back on a stream of its own (which waits for nothing) and declares
  the rows late; the checker's verdict does not depend on the order of declarations.

An index whose rows never become known by the end of the test is said in a note, and its access
is not checked (a missed race, never a false one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from racecheck.dtypes import NUMPY_INTEGERS
from racecheck.hb import OpStamp
from racecheck.ops import indexed_rows
from racecheck.ranges import byte_runs, row_runs

@dataclass(frozen=True)
class Target:
    """Where an indexed op's rows lie, without holding the tensor (its memory is the program's to
    free): the allocation's address, the view's first byte and a meta tensor of its shape and strides."""
    address: int
    base: int
    shape: torch.Tensor
    dim: int

    @classmethod
    def of(cls, tensor: torch.Tensor, dim: int) -> "Target":
        with torch._C.DisableTorchFunction():
            shape = torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=tensor.dtype, device="meta")
        return cls(tensor.untyped_storage().data_ptr(), tensor.data_ptr(), shape, dim)

    def rows(self, rows: list[int] | None) -> list[tuple[int, int]]:
        """The bytes of ``rows`` (all of the view for None)."""
        runs = byte_runs(self.shape) if rows is None else row_runs(self.shape, self.dim, rows)
        return [(self.base + s, self.base + e) for s, e in runs]


@dataclass
class _Unresolved:
    stamp: OpStamp
    target: Target
    index: torch.Tensor
    write: bool
    generation: int
    what: str


class Indices:
    """Known index values and the indexed accesses still waiting for theirs (module docstring)."""

    def __init__(self, observer: Any) -> None:
        self.obs = observer
        self._generation: dict[int, int] = {}  # device storage address -> writes declared so far
        self._unresolved: list[_Unresolved] = []
        self._stream: Any = None

    # -- what the device holds ---------------------------------------------------------------------
    def written(self, address: int) -> None:
        """A device write to the storage at ``address``: an index there read back late may no
        longer be what the op saw."""
        self._generation[address] = self._generation.get(address, 0) + 1

    def values(self, index: torch.Tensor) -> list[int] | None:
        """``index``'s values where they are known (host memory, or the observer's shadow of
        device values), else None."""
        if not self.obs.device.is_device(index):
            if index.dtype not in NUMPY_INTEGERS:
                return None
            with torch._C.DisableTorchFunction():
                return [int(v) for v in index.reshape(-1).tolist()]
        known = self.obs.values.values(index)
        return None if known is None else known.reshape(-1).tolist()

    # -- declaring an op's accesses ------------------------------------------------------------------
    def declare(self, func: Any, args: tuple, kwargs: dict, stamp: OpStamp, on_device: list[torch.Tensor],
                written: list[torch.Tensor]) -> None:
        """Declare ``stamp``'s reads and writes of ``on_device`` (the indexed tensor by its rows)."""
        obs = self.obs
        indexed = indexed_rows(func, args, kwargs)
        target = None
        if indexed is not None:
            position, dim, index, write = indexed
            candidate = args[position] if position < len(args) else None
            if isinstance(candidate, torch.Tensor) and obs.device.is_device(candidate):
                target = candidate
                rows = self.values(index)
                if rows is not None:
                    obs.device_access(target, stamp, write=write, ranges=row_runs(target, dim, rows))
                else:
                    self.defer(stamp, Target.of(target, dim), index, write)
        for tensor in on_device:
            if tensor is target:
                continue
            obs.device_access(tensor, stamp, write=any(tensor is w for w in written))

    def defer(self, stamp: OpStamp, target: Target, index: torch.Tensor, write: bool) -> None:
        """``stamp`` touches the rows of ``target`` that ``index`` names, values not known yet: they
        are declared once the host has seen the op run (:meth:`resolve`), or said in a note."""
        address = index.untyped_storage().data_ptr()
        with torch._C.DisableTorchFunction():
            self._unresolved.append(_Unresolved(
                stamp, target, index.detach(), write, self._generation.get(address, 0),
                getattr(stamp.label, "access", None) and stamp.label.access.what or str(stamp.label)))

    # -- late resolution -----------------------------------------------------------------------------
    def resolve(self) -> None:
        """The host has learned more: indexed ops that ran, over an index nothing has rewritten
        since, get their rows now."""
        if not self._unresolved:
            return
        hb = self.obs.hb
        still: list[_Unresolved] = []
        for entry in self._unresolved:
            if not hb.seen_by_some_host(entry.stamp):
                still.append(entry)
                continue
            address = entry.index.untyped_storage().data_ptr()
            if self._generation.get(address, 0) != entry.generation:
                self._note(entry, "its index tensor was written again before the host saw the op run")
                continue
            rows = self._read_back(entry.index)
            target = entry.target
            self.obs.device_access_at(target.address, target.rows(rows), entry.stamp, write=entry.write, late=True)
        self._unresolved = still

    def finish(self) -> None:
        """The scope ends: what could not be resolved is said, not guessed."""
        self.resolve()
        for entry in self._unresolved:
            self._note(entry, "the host never saw the op run")
        self._unresolved = []

    def _read_back(self, index: torch.Tensor) -> list[int]:
        obs = self.obs
        with obs.own_work():
            if self._stream is None:
                self._stream = obs.device.private_stream()
            host = obs.device.read_back(index, self._stream)
            with torch._C.DisableTorchFunction():
                return [int(v) for v in host.reshape(-1).tolist()]

    def _note(self, entry: _Unresolved, why: str) -> None:
        site = entry.stamp.label.access.where() if hasattr(entry.stamp.label, "access") else ""
        self.obs.notes.append(f"kvz-sanitize could not tell which rows {entry.what} {site} touches ({why}); "
                              f"its access to them is not checked")


__all__ = ["Indices", "Target", "byte_runs"]
