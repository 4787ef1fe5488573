"""Ours, for production: a ring of staging slots, each call replayed from a CUDA graph. Race-free.

The slot protocol (:mod:`zeroer.designs.graph_ring_protocol`) is event_ring's: a slot is rewritten only
after the host has *seen* the event recorded behind the last work that read it. This module is
its CUDA form; :mod:`zeroer.designs.modelled_graph_ring` runs the same protocol code on our
runtime, so the simulator and the controlled cuda mode fuzz it too (``make_graph_ring`` picks the
form from the runtime it is given).

What makes this form cheap is what a call does not do. vLLM #48399's fresh pinned tensor costs
an allocator round trip, a torch copy and a Triton launch through Python, 27 to 62 us of host
time on an H200 host (docs/performance.md). Here, per call:

* a list of plain ints is packed into the slot's pinned memory with one ``struct`` call and
  range-checked there (other input goes through ``validate_block_ids`` first);
* one ``cuGraphLaunch`` replays the slot's graph for the smallest power of two >= n ids: the
  host-to-device copy of the slot and the zero kernel, captured once; the ids past n are -1,
  which the kernel's ``skip_negative`` variant skips (a graph's id count is fixed);
* one ``cuEventRecord`` on the current stream, and one ``cuEventQuery`` when the slot comes
  round again: the driver's calls on raw handles (:mod:`zeroer.designs.cuda_driver`).

More than ``max_graph_ids`` ids in one call go through a fresh pinned tensor, as per_call does
(rare: a step allocating that many blocks is a big prefill). When the cache's table changes (the
KV cache was reallocated) every graph is dropped and captured again; a graph still queued
completes first (``cuGraphExecDestroy``: "freed asynchronously on completion").

It calls torch.cuda and the driver directly, not our runtime, so it runs on the cuda backend
only, in the fuzzer's free-running mode, judged by the value oracle (docs/zeroer-api.md).

Example (needs a GPU)::

    z = GraphRingZeroer(cache)
    z.zero_block_ids([3, 9])      # first call of this size: captures slot 0's 2-id graph
    z.zero_block_ids([4])         # replays slot 1's 1-id graph
"""

from __future__ import annotations

import functools
import gc
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from zeroer.designs.common import is_plain_int_list, validate_block_ids
from zeroer.kernel import zero_blocks
from zeroer.protocol import Capabilities, IDS_CONTAINERS
from zeroer.cache.layout import KVCache
from kvdevice.runtime import Runtime
from zeroer.designs.cuda_driver import CUDA_ERROR_NOT_READY, CUDA_SUCCESS, Driver, load_driver
from zeroer.designs.modelled_graph_ring import ModelledGraphRing
from zeroer.designs.torch_per_call import TorchPerCallZeroer
from zeroer.designs.graph_ring_protocol import (DEFAULT_MAX_GRAPH_IDS, DEFAULT_MAX_SLOTS, DEFAULT_SLOTS, PAD, GraphRingProtocol,
                            GraphSlot, graph_size)

ID_BYTES = 8  # int64
SMALL = 64  # up to this many ids, Python's min/max beat NumPy's on the staged copy


@functools.cache
def _packer(n: int) -> struct.Struct:
    """Packs ``n`` Python ints as native int64s: C-speed, and it rejects what is not an int."""
    return struct.Struct(f"={n}q")


@dataclass
class _Slot(GraphSlot):
    # Defaults only so the dataclass can follow GraphSlot's; _new_slot sets every field.
    host: Any = None  # pinned int64[max_graph_ids]
    host_np: Any = None  # a NumPy view of it: what struct packs into and NumPy range-checks
    dev: Any = None  # int64[max_graph_ids] on the GPU, read by the zero kernel
    event: Any = None  # torch.cuda.Event recorded behind the last graph that read this slot
    event_handle: int = 0


class GraphRingZeroer(GraphRingProtocol):
    """vLLM's ``zero_block_ids`` through a ring of CUDA-graph slots (see the module docstring)."""

    # It captures CUDA graphs, and waits on events itself: a gated stream would hold it forever.
    capabilities = Capabilities(api="runtime", ids_as=IDS_CONTAINERS, backends=("cuda",), cuda_modes=("free",), follows_reallocation=True)

    def __init__(self, cache: KVCache, runtime: object = None, *, slots: int = DEFAULT_SLOTS,
                 max_slots: int = DEFAULT_MAX_SLOTS, max_graph_ids: int = DEFAULT_MAX_GRAPH_IDS) -> None:
        super().__init__(cache, slots=slots, max_slots=max_slots, max_graph_ids=max_graph_ids)
        if cache.device.type != "cuda":
            raise ValueError(
                f"graph_ring's CUDA form captures CUDA graphs, but the cache lives on {cache.device}; "
                f"build it with build_cache(spec, device='cuda'), or use make_graph_ring(cache, runtime), "
                f"which runs the same protocol on the simulator"
            )
        driver = load_driver()
        if driver is None:
            raise RuntimeError("graph_ring needs the CUDA driver library libcuda.so.1, which could not be loaded")
        self._driver: Driver = driver
        # The bare ctypes functions, looked up once: the per-call path is a few microseconds.
        self._graph_launch = driver.fn["cuGraphLaunch"]
        self._event_record = driver.fn["cuEventRecord"]
        self._event_query = driver.fn["cuEventQuery"]
        self.device = cache.device
        self.index = cache.device.index if cache.device.index is not None else torch.cuda.current_device()
        self._raw_stream: Callable[[int], int] = getattr(
            torch._C, "_cuda_getCurrentRawStream", lambda i: torch.cuda.current_stream(i).cuda_stream)
        # Launch through the driver where torch hands out the executable graph, else replay().
        self._raw_exec = hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec")
        self._capture_stream = torch.cuda.Stream(self.device)
        self._unstaged = TorchPerCallZeroer(cache)  # calls of more than max_graph_ids ids
        with torch.cuda.device(self.index):
            # Compile the skip_negative kernel now, zeroing nothing: capture must not compile
            # (it loads a module), and the first call should not pay for it.
            zero_blocks(self._table, torch.full((1,), PAD, dtype=torch.int64, device=self.device),
                        skip_negative=True)
            self._open_slots()

    # -- the call ------------------------------------------------------------------------------
    def zero_block_ids(self, block_ids: Iterable[int] | None) -> None:
        if is_plain_int_list(block_ids) and len(block_ids) <= self.max_graph_ids:
            # vLLM's call, a list of plain ints: packed straight into an idle slot and
            # range-checked there, which is cheaper than checking the list and then converting it.
            # A bad id raises before anything is queued; the slot is left idle.
            n = len(block_ids)
            slot = self._acquire()
            try:
                _packer(n).pack_into(slot.host_np, 0, *block_ids)
            except struct.error:  # an int past int64: out of range, said the usual way below
                low = high = -1
            else:
                low, high = self._bounds(block_ids, slot, n)
            if low < 0 or high >= self.num_blocks:
                validate_block_ids(block_ids, self.num_blocks)  # raises, naming the id
            count = graph_size(n)
            if count > n:
                slot.host_np[n:count] = PAD
            self._replay(slot, block_ids)
            return
        super().zero_block_ids(block_ids)

    @staticmethod
    def _bounds(block_ids: list[int], slot: _Slot, n: int) -> tuple[int, int]:
        if n <= SMALL:
            return min(block_ids), max(block_ids)
        staged = slot.host_np[:n]
        return int(staged.min()), int(staged.max())

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: CUDA may be gone already
            pass

    # -- slot operations (ring_protocol) ----------------------------------------------------------
    def _new_slot(self) -> _Slot:
        cap = self.max_graph_ids
        with torch.cuda.device(self.index):
            host = torch.full((cap,), PAD, dtype=torch.int64, pin_memory=True)
            event = torch.cuda.Event()
            event.record(self._capture_stream)  # creates the CUDA event, so its handle exists
            dev = torch.full((cap,), PAD, dtype=torch.int64, device=self.device)
        return _Slot(host=host, host_np=host.numpy(), dev=dev, event=event, event_handle=int(event.cuda_event))

    def _done(self, slot: _Slot) -> bool:
        status = self._event_query(slot.event_handle)
        if status == CUDA_SUCCESS:
            return True
        if status == CUDA_ERROR_NOT_READY:
            return False
        return self._driver.event_done(slot.event_handle, self.index)  # recovers, or raises

    def _wait(self, slot: _Slot) -> None:
        slot.event.synchronize()

    def _stage(self, slot: _Slot, ids: list[int]) -> None:
        n, count = len(ids), graph_size(len(ids))
        _packer(n).pack_into(slot.host_np, 0, *ids)
        slot.host_np[n:count] = PAD

    def _capture(self, slot: _Slot, count: int) -> object:
        """Capture the copy of ``count`` ids and the zero kernel into a graph for this slot.

        Returns the raw executable graph's handle where torch gives it out, else the graph.
        """
        graph = torch.cuda.CUDAGraph()
        # No garbage collection inside the capture. A collection there runs finalizers in this
        # thread, and one that destroys a CUDA graph (CUDAGraph.reset) or waits on an event (a
        # dropped ring's close) is an operation a capturing thread may not make: the capture is
        # invalidated and capture_end raises "operation not permitted when stream is capturing".
        # Seen on the H200 (docs/zeroer-api.md): graphs of earlier fuzz examples collected mid-capture.
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.device(self.index), torch.cuda.stream(self._capture_stream):
                # thread_local: other threads (a runtime's watchdog) may use CUDA meanwhile.
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    # The driver's copy, not Tensor.copy_: torch's pinned allocator would record an
                    # event on the capturing stream and query it when the slot is freed.
                    self._driver.call("cuMemcpyHtoDAsync", self.index, slot.dev.data_ptr(), slot.host.data_ptr(),
                                      count * ID_BYTES, self._capture_stream.cuda_stream)
                    zero_blocks(self._table, slot.dev[:count], skip_negative=True)
                finally:
                    graph.capture_end()
        finally:
            if collecting:
                gc.enable()
        slot.owned.append(graph)  # dropped on a retarget; a queued launch still completes
        return int(graph.raw_cuda_graph_exec()) if self._raw_exec else graph

    def _launch(self, slot: _Slot, graph: object, ids: list[int]) -> None:
        stream = self._raw_stream(self.index)
        if type(graph) is int:
            status = self._graph_launch(graph, stream)
            if status:
                self._driver.recover("cuGraphLaunch", status, self.index, graph, stream)
        else:
            with torch.cuda.device(self.index):
                graph.replay()  # on torch's current stream: the one the event is recorded on

    def _record(self, slot: _Slot) -> None:
        stream = self._raw_stream(self.index)
        status = self._event_record(slot.event_handle, stream)
        if status:
            self._driver.recover("cuEventRecord", status, self.index, slot.event_handle, stream)

    def _zero_unstaged(self, ids: list[int]) -> None:
        # torch_per_call's staging: the pinned allocator keeps the tensor until the copy has read it.
        with torch.cuda.device(self.index):
            self._unstaged.zero_block_ids(ids)


def make_graph_ring(cache: KVCache, runtime: Runtime | None = None, **options: Any) -> GraphRingProtocol:
    """graph_ring in the form ``runtime`` calls for: real CUDA graphs through the driver on a GPU
    whose runtime issues work as it comes (``None``, or cuda's free-running mode), else the same
    protocol on ``runtime`` with each graph modelled as its copy and kernel (the simulator, the
    controlled cuda mode). ``options`` are the ring's (``slots``, ``max_slots``, ``max_graph_ids``)."""
    if runtime is None or (runtime.device.type == "cuda" and not runtime.scheduled):
        return GraphRingZeroer(cache, runtime, **options)
    return ModelledGraphRing(cache, runtime, **options)


make_graph_ring.name = "graph_ring"  # type: ignore[attr-defined]
make_graph_ring.capabilities = Capabilities(api="runtime", ids_as=IDS_CONTAINERS, follows_reallocation=True)  # type: ignore[attr-defined]
