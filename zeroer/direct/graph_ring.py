"""Ours, for production: event_ring's slot protocol, each call replayed from a CUDA graph. Race-free.

The protocol is event_ring's (``zeroer.impls.event_ring``, fuzzed on the simulator and on the
GPU): a ring of persistent pinned/device id slots; a slot is rewritten only after the host has
*seen* the event recorded behind the last work that read it, which covers both hazards of slot
reuse (the host rewriting pinned memory a queued copy still reads, vLLM #48085; a copy on
another stream overwriting device ids a queued kernel still reads). When every slot is busy the
ring grows, up to ``max_slots``, then waits for the oldest.

What makes it cheap is what a call does not do. vLLM #48399's fresh pinned tensor costs an
allocator round trip, a torch copy and a Triton launch through Python, 27 to 62 us of host
time on an H200 host (docs/performance.md; 8 to 41 us here). Here, per call:

* a list of plain ints is packed into the slot's pinned memory with one ``struct`` call and
  range-checked there (other input goes through ``validate_block_ids`` first);
* one ``cuGraphLaunch`` replays the slot's graph for the smallest power of two >= n ids: the
  host-to-device copy of the slot and the zero kernel, captured once; the ids past n are -1,
  which the kernel's ``skip_negative`` variant skips (a graph's id count is fixed);
* one ``cuEventRecord`` on the current stream, and one ``cuEventQuery`` when the slot comes
  round again: the driver's calls on raw handles (:mod:`zeroer.direct.driver`).

More than ``max_graph_ids`` ids in one call go through a fresh pinned tensor, as per_call does
(rare: a step allocating that many blocks is a big prefill). A graph holds the segment table's
addresses, so when the cache's table changes (the KV cache was reallocated) every graph is
dropped and captured again; a graph still queued completes first (``cuGraphExecDestroy``:
"freed asynchronously on completion").

It calls torch.cuda and the driver directly, not our runtime, so it runs on the cuda backend
only, in the fuzzer's free-running mode, judged by the value oracle (docs/zeroer-api.md).

Example (needs a GPU)::

    z = GraphRingZeroer(cache)
    z.zero_block_ids([3, 9])      # first call of this size: captures slot 0's 2-id graph
    z.zero_block_ids([4])         # replays slot 1's 1-id graph
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..impls.common import is_plain_int_list, validate_block_ids
from ..kernel import zero_blocks
from ..layout import KVCache, SegmentTable
from .driver import CUDA_SUCCESS, Driver, load_driver

DEFAULT_SLOTS = 2
DEFAULT_MAX_SLOTS = 64
DEFAULT_MAX_GRAPH_IDS = 1024
PAD = -1  # an id the skip_negative kernel zeroes nothing for
ID_BYTES = 8  # int64
SMALL = 64  # up to this many ids, Python's min/max beat NumPy's on the staged copy


@functools.cache
def _packer(n: int) -> struct.Struct:
    """Packs ``n`` Python ints as native int64s: C-speed, and it rejects what is not an int."""
    return struct.Struct(f"={n}q")


@dataclass
class _Slot:
    host: torch.Tensor  # pinned int64[max_graph_ids]
    host_np: Any  # a NumPy view of it: what struct packs into and NumPy range-checks
    dev: torch.Tensor  # int64[max_graph_ids] on the GPU, read by the zero kernel
    event: torch.cuda.Event  # recorded behind the last graph that read this slot
    event_handle: int
    busy: bool = False  # a graph was launched since the event was last seen complete
    graphs: dict[int, torch.cuda.CUDAGraph] = field(default_factory=dict)  # id count -> graph
    execs: dict[int, int] = field(default_factory=dict)  # id count -> raw cudaGraphExec_t


class GraphRingZeroer:
    """vLLM's ``zero_block_ids`` through a ring of CUDA-graph slots (see the module docstring)."""

    name = "graph_ring"
    backends = ("cuda",)  # it captures CUDA graphs
    modes = ("free",)  # it waits on events itself: a gated stream would hold it forever
    follows_reallocation = True  # it reads cache.table on every call

    def __init__(self, cache: KVCache, runtime: object = None, *, slots: int = DEFAULT_SLOTS,
                 max_slots: int = DEFAULT_MAX_SLOTS, max_graph_ids: int = DEFAULT_MAX_GRAPH_IDS) -> None:
        for name, value in (("slots", slots), ("max_slots", max_slots), ("max_graph_ids", max_graph_ids)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if max_slots < slots:
            raise ValueError(f"max_slots={max_slots} is below slots={slots}; raise max_slots")
        if max_graph_ids & (max_graph_ids - 1):
            raise ValueError(f"max_graph_ids={max_graph_ids} must be a power of two (graphs are captured "
                             f"for 1, 2, 4, ... ids), e.g. {1 << max_graph_ids.bit_length()}")
        if cache.device.type != "cuda":
            raise ValueError(
                f"graph_ring captures CUDA graphs, but the cache lives on {cache.device}; build it "
                f"with build_cache(spec, device='cuda'), or use event_ring (the same protocol) on the simulator"
            )
        driver = load_driver()
        if driver is None:
            raise RuntimeError("graph_ring needs the CUDA driver library libcuda.so.1, which could not be loaded")
        self._driver: Driver = driver
        # The bare ctypes functions, looked up once: the per-call path is a few microseconds.
        self._graph_launch = driver.fn["cuGraphLaunch"]
        self._event_record = driver.fn["cuEventRecord"]
        self._event_query = driver.fn["cuEventQuery"]
        self.cache = cache
        self.num_blocks = cache.spec.num_blocks
        self.device = cache.device
        self.index = cache.device.index if cache.device.index is not None else torch.cuda.current_device()
        self.max_slots = max_slots
        self.max_graph_ids = max_graph_ids
        self._raw_stream: Callable[[int], int] = getattr(
            torch._C, "_cuda_getCurrentRawStream", lambda i: torch.cuda.current_stream(i).cuda_stream)
        # Launch through the driver where torch hands out the executable graph, else replay().
        self._raw_exec = hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec")
        self._capture_stream = torch.cuda.Stream(self.device)
        self._table: SegmentTable = cache.table
        with torch.cuda.device(self.index):
            # Compile the skip_negative kernel now, zeroing nothing: capture must not compile
            # (it loads a module), and the first call should not pay for it.
            zero_blocks(self._table, torch.full((1,), PAD, dtype=torch.int64, device=self.device),
                        skip_negative=True)
            self._slots = [self._new_slot() for _ in range(slots)]
        self._next = 0
        self.grown = 0  # slots added because every slot was busy
        self.waited = 0  # calls that waited for a slot (the ring at max_slots)
        self.captures = 0  # graphs captured, recaptures after a reallocation included
        self.unstaged_calls = 0  # calls of more than max_graph_ids ids (fresh pinned tensor)

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
            self._replay(slot, n)
            return
        ids = validate_block_ids(block_ids, self.num_blocks)
        if not ids:
            return
        if len(ids) > self.max_graph_ids:
            self._zero_unstaged(ids)
            return
        slot = self._acquire()
        _packer(len(ids)).pack_into(slot.host_np, 0, *ids)
        self._replay(slot, len(ids))

    @staticmethod
    def _bounds(block_ids: list[int], slot: _Slot, n: int) -> tuple[int, int]:
        if n <= SMALL:
            return min(block_ids), max(block_ids)
        staged = slot.host_np[:n]
        return int(staged.min()), int(staged.max())

    def _replay(self, slot: _Slot, n: int) -> None:
        """Queue the slot's graph for ``n`` ids (its first ``n`` words) on the current stream."""
        count = 1 << (n - 1).bit_length()
        if count > n:
            slot.host_np[n:count] = PAD
        if self.cache.table is not self._table:
            self._retarget(self.cache.table)
        stream = self._raw_stream(self.index)
        graph_exec = slot.execs.get(count)
        if graph_exec is None and count not in slot.graphs:
            graph_exec = self._capture(slot, count)
        if graph_exec is not None:
            status = self._graph_launch(graph_exec, stream)
            if status:
                self._driver.recover("cuGraphLaunch", status, self.index, graph_exec, stream)
        else:
            with torch.cuda.device(self.index):
                slot.graphs[count].replay()  # on torch's current stream: the one read above
        status = self._event_record(slot.event_handle, stream)
        if status:
            self._driver.recover("cuEventRecord", status, self.index, slot.event_handle, stream)
        slot.busy = True

    def warmup(self) -> None:
        """Zero the null block 0, as vLLM's warm-up does (captures slot 0's one-id graph)."""
        self.zero_block_ids([0])

    @property
    def slot_count(self) -> int:
        return len(self._slots)

    def close(self) -> None:
        """Wait for the work queued on every slot, so its pinned memory can go back to torch.

        Called when the zeroer is dropped: torch's pinned allocator would hand a slot's memory
        to someone else at once, while a queued copy may still read it (#48085 again).
        """
        for slot in getattr(self, "_slots", ()):
            if slot.busy:
                slot.event.synchronize()
                slot.busy = False

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: CUDA may be gone already
            pass

    # -- slots -----------------------------------------------------------------------------------
    def _new_slot(self) -> _Slot:
        cap = self.max_graph_ids
        host = torch.full((cap,), PAD, dtype=torch.int64, pin_memory=True)
        event = torch.cuda.Event()
        event.record(self._capture_stream)  # creates the CUDA event, so its handle exists
        return _Slot(host, host.numpy(), torch.full((cap,), PAD, dtype=torch.int64, device=self.device),
                     event, int(event.cuda_event))

    def _idle(self, slot: _Slot) -> bool:
        if slot.busy and self._driver.event_done(slot.event_handle, self.index):
            slot.busy = False
        return not slot.busy

    def _acquire(self) -> _Slot:
        slot = self._slots[self._next]
        if not slot.busy or self._event_query(slot.event_handle) == CUDA_SUCCESS:
            # The common case, checked without the loop: the next slot is idle.
            slot.busy = False
            self._next = (self._next + 1) % len(self._slots)
            return slot
        count = len(self._slots)
        for k in range(count):
            i = (self._next + k) % count
            if self._idle(self._slots[i]):
                break
        else:
            if count < self.max_slots:
                with torch.cuda.device(self.index):
                    self._slots.append(self._new_slot())
                self.grown += 1
                i = count
            else:
                i = self._next
                self.waited += 1
                self._slots[i].event.synchronize()
                self._slots[i].busy = False
        self._next = (i + 1) % len(self._slots)
        return self._slots[i]

    # -- graphs ----------------------------------------------------------------------------------
    def _capture(self, slot: _Slot, count: int) -> int | None:
        """Capture the copy of ``count`` ids and the zero kernel into a graph for this slot."""
        graph = torch.cuda.CUDAGraph()
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
        slot.graphs[count] = graph
        self.captures += 1
        if self._raw_exec:
            slot.execs[count] = int(graph.raw_cuda_graph_exec())
            return slot.execs[count]
        return None

    def _retarget(self, table: SegmentTable) -> None:
        # The cache was reallocated: every graph holds the old table's addresses.
        for slot in self._slots:
            slot.graphs.clear()
            slot.execs.clear()
        self._table = table

    def _zero_unstaged(self, ids: list[int]) -> None:
        # What per_call does: the pinned allocator keeps the tensor until the copy has read it.
        self.unstaged_calls += 1
        staged = torch.tensor(ids, dtype=torch.int64, pin_memory=True)
        with torch.cuda.device(self.index):
            zero_blocks(self.cache.table, staged.to(self.device, non_blocking=True))
