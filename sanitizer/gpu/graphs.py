"""CUDA graphs: what a capture records, and what each replay then does to memory.

Work captured into a CUDA graph does not run at capture; it runs at every replay, on the stream
``replay()`` is called on, reading whatever its pinned inputs hold then (onnxruntime #32121: the host
rewrote a graph's static pinned input while a replay was queued). So while a thread captures
(``CUDAGraph.capture_begin`` to ``capture_end``, which ``torch.cuda.graph`` and
``make_graphed_callables`` call), every op it issues is recorded, not checked: the device bytes it
reads and writes and the pinned host bytes a copy reads or writes. Each ``replay()`` is then those
ops, in order, queued on the replay stream: stamped, checked against everything else, a snapshot of
each pinned input taken as it is at the replay, a pending write for each pinned output; force mode
holds the whole replay behind a gate. An indexed op in the graph touches the rows its index holds at
that replay (resolved as :mod:`sanitizer.gpu.indices` resolves any op's). A record keeps addresses
and byte runs, not the program's tensors (an indexed op keeps a view of its index). A report names
the captured op and the replay's line.

Not modelled: an order inside one graph (its captured ops are checked as one stream), and a graph
captured by one thread and replayed by another (followed like any op of the replaying thread).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from racecheck.ops import indexed_rows, op_name
from racecheck.pinned import Region
from racecheck.ranges import Runs, byte_runs
from sanitizer.gpu.dispatch import fresh_outputs, written_tensors
from sanitizer.gpu.indices import Target
from sanitizer.sites import Site


@dataclass
class _Indexed:
    """A captured indexed op's target: its rows are those its index holds at each replay (a graph
    reads the static index buffer the host restaged before ``replay()``)."""
    target: Target
    index: torch.Tensor  # a small view; the graph's replays read its memory anyway
    write: bool


@dataclass
class _Captured:
    what: str
    site: Site
    # (device allocation address, write, byte runs): addresses, not tensors, so that a recorded
    # graph keeps no tensor alive and the caching allocator sees the program's own frees.
    device: list[tuple[int, bool, Runs]] = field(default_factory=list)
    indexed: _Indexed | None = None
    staged: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (device dst, pinned src)
    pinned_reads: list[tuple[Region, torch.Tensor]] = field(default_factory=list)
    pinned_writes: list[tuple[Region, torch.Tensor]] = field(default_factory=list)

    def touch(self, tensor: torch.Tensor, write: bool, runs: Runs | None = None) -> None:
        address = tensor.untyped_storage().data_ptr()
        if address:
            self.device.append((address, write, byte_runs(tensor) if runs is None else runs))


class GraphRecord:
    """The ops one capture recorded."""

    def __init__(self, site: Site) -> None:
        self.site = site
        self.ops: list[_Captured] = []

    def op(self, handler: Any, func: Any, args: tuple, kwargs: dict, what: str, on_device: list[torch.Tensor],
           site: Site) -> Any:
        """Record one op issued under capture, then let torch capture it (called under the lock)."""
        obs, device = handler.obs, handler.device
        captured = _Captured(op_name(func), site)
        if what == "copy" or what == "to_copy":
            dst = args[0] if what == "copy" else None
            src = args[1] if what == "copy" else args[0]
            if device.is_device(src):
                captured.touch(src, False)
            elif dst is not None and device.is_device(dst):
                region = obs.region_of(src)
                if region is not None:
                    with torch._C.DisableTorchFunction():
                        captured.pinned_reads.append((region, src.detach()))
                        captured.staged.append((dst.detach(), src.detach()))
            if dst is not None and device.is_device(dst):
                captured.touch(dst, True)
            elif dst is not None:
                region = obs.region_of(dst)
                if region is not None:
                    captured.pinned_writes.append((region, dst.detach()))
            result = func(*args, **kwargs)
            if dst is None and isinstance(result, torch.Tensor):
                if device.is_device(result):
                    captured.touch(result, True)
                else:
                    region = obs.note_pinned(result, site, "the pinned result of a captured .to('cpu')")
                    captured.pinned_writes.append((region, result.detach()))
            self.ops.append(captured)
            return result
        written = written_tensors(func, args, kwargs)
        indexed = indexed_rows(func, args, kwargs)
        for tensor in on_device:
            write = any(tensor is w for w in written)
            if indexed is not None and tensor is args[indexed[0]] and isinstance(indexed[2], torch.Tensor):
                _, dim, index, writes = indexed
                with torch._C.DisableTorchFunction():
                    captured.indexed = _Indexed(Target.of(tensor, dim), index.detach(), writes)
                continue
            captured.touch(tensor, write)
        result = func(*args, **kwargs)
        for out in fresh_outputs(func, result, device, on_device):
            captured.touch(out, True)
        self.ops.append(captured)
        return result

    def triton(self, what: str, site: Site, accesses: list[tuple[torch.Tensor, bool]],
               pinned: list[tuple[Region, torch.Tensor, bool]]) -> None:
        captured = _Captured(what, site)
        for tensor, write in accesses:
            captured.touch(tensor, write)
        for region, tensor, stored in pinned:
            (captured.pinned_writes if stored else captured.pinned_reads).append((region, tensor.detach()))
        self.ops.append(captured)


class Graphs:
    """The captures in progress and the graphs they recorded (see the module docstring)."""

    def __init__(self, observer: Any) -> None:
        self.obs = observer
        self._capturing: dict[int, GraphRecord] = {}  # thread ident -> the capture it runs
        self._records: "weakref.WeakKeyDictionary[Any, GraphRecord]" = weakref.WeakKeyDictionary()

    def capturing(self) -> GraphRecord | None:
        """The capture the calling thread is in, if any."""
        if not self._capturing:
            return None
        return self._capturing.get(threading.get_ident())

    def begin(self, graph: Any, site: Site) -> None:
        record = GraphRecord(site)
        self._capturing[threading.get_ident()] = record
        self._records[graph] = record

    def end(self, graph: Any) -> None:
        self._capturing.pop(threading.get_ident(), None)

    def replay(self, graph: Any, site: Site) -> Any:
        """``graph.replay()`` at ``site`` is about to be issued: queue its ops; the held gate, if any."""
        record = self._records.get(graph)
        if record is None:
            return None
        obs = self.obs
        index = obs.device.device_index(None)
        held = obs.hold(index) if any(op.pinned_reads or op.pinned_writes for op in record.ops) else None
        stream = obs.device.current_stream(index)
        for captured in record.ops:
            stamp = obs.enqueue(f"{captured.what} (captured into the CUDA graph at {record.site.short}, replayed)",
                                stream, site)
            for address, write, runs in captured.device:
                obs.device_access_at(address, runs, stamp, write=write)
            if captured.indexed is not None:
                self._indexed(captured.indexed, stamp)
            for dst, src in captured.staged:
                obs.values.copied(dst, src)  # the ids the replay stages, as an eager copy's (racecheck.device_values)
            for region, view in captured.pinned_reads:
                obs.queued_read(region, view, stamp, held, keep=view)
            for region, view in captured.pinned_writes:
                obs.queued_write(region, view, stamp, held)
        obs.collect()
        return held

    def _indexed(self, indexed: _Indexed, stamp: Any) -> None:
        """The rows a replayed indexed op touches: those its index holds now, else declared once the
        host has seen the replay run (:meth:`~sanitizer.gpu.indices.Indices.defer`)."""
        obs = self.obs
        rows = obs.indices.values(indexed.index)
        if rows is None:
            obs.indices.defer(stamp, indexed.target, indexed.index, indexed.write)
        else:
            obs.device_access_at(indexed.target.address, indexed.target.rows(rows), stamp, write=indexed.write)
