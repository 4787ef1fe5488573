"""KV offloaders written the way engine code writes them: plain torch and torch.cuda.

Nothing here imports the fuzzer's runtime. Each factory builds an offloader for a device KV cache
and a host pool of the same layout (``cache.layer_tensors`` and ``host_pool.layer_tensors``: layer
name -> tensor, ``cache.spec`` for the layouts), with the three calls of docs/offload-contract.md:
``store(job_id, block_ids, slot_ids)``, ``load(job_id, slot_ids, block_ids)`` and
``get_finished()``. Like vLLM's CPU offload handlers they copy each block with non-blocking
copies on a transfer stream of their own, one per direction, record a CUDA event after each job
and report a job once its event has completed. They differ where the engines' recent KV
corruption bugs were; each pattern comes racy and race-free:

===================================  ====================================================================  =========
factory                              what it does                                                          verdict
===================================  ====================================================================  =========
``store_without_compute_event``      the store stream copies blocks without waiting for the compute        racy
                                     stream that wrote them (vLLM #46278, issue #45704)
``store_after_compute_event``        an event recorded on the compute stream, waited by the store stream   race-free
``load_unfenced``                    the load stream writes reused blocks without waiting for the          racy
                                     forward stream's earlier use of them (SGLang #36738)
``load_waits_forward``               the load stream waits for the forward stream first                    race-free
``load_acked_on_issue``              a load is acknowledged when it is queued, so the caller recycles      racy
                                     its host slot (and uses its block) mid-load
``load_acked_on_event``              acknowledged once its event has completed                             race-free
``host_lock_released_on_issue``      a load is acknowledged once its event has completed, but the lock     racy
                                     that keeps its host slot from eviction (``evict``) is released
                                     when it is queued: the caller frees and refills the slot mid-load
                                     (SGLang #27444, #31427)
``host_lock_held_until_loaded``      the lock is held until the load is acknowledged                       race-free
``staging_freed_on_return``          loads stage through a pool of pinned temporaries, given back as       racy
                                     soon as the copy is queued (LMCache #4830)
``staging_freed_after_event``        a temporary is given back once the copy that reads it has completed   race-free
``copy_thread_without_compute_event`` copies issued by a background thread fed by a queue (vLLM's          racy
                                     SimpleCPUOffload), the store stream not waiting for the compute stream
``copy_thread_after_compute_event``  the thread's store stream waits for an event the caller recorded      race-free
``report_without_end_query``         vLLM's handler shape (``transfer_async``, two timing events per job);  racy
                                     ``get_finished()`` reports every job it queued and times it with
                                     ``start.elapsed_time(end)``, its end event never queried
``report_after_end_query``           reports (and times) a job once its end event has completed            race-free
``report_on_start_query``            reports a job once its *start* event has completed: its stream may     racy
                                     have passed the start while its copies are still queued
===================================  ====================================================================  =========

The copy-thread pair also takes the idioms around engines' transfers: low-priority streams from
``torch.cuda.Stream.priority_range()``, two timing events per job from a pool, ``elapsed_time``
reported as a metric, and a ``threading.Event`` per job that ``wait`` blocks on until the thread has
issued it.

The report pair is vLLM's CPU offloading handler (``SingleDirectionOffloadingHandler`` of
``vllm/v1/kv_offload/worker/cpu_gpu.py``): ``transfer_async(job_id, (src, dst))``, a stream and two
timing events from pools per job, ``get_finished()`` returning ``TransferResult``s with each job's
transfer time. The racy one reports a job without asking its end event: CUDA refuses
``start.elapsed_time(end)`` while the end event has not completed, so the early report surfaces as
CUDA's error in the handler's own call (a ``cuda error`` finding, docs/offload-contract.md).

``VERDICTS`` says the same to the tools. Fuzz one as it is, on the CPU simulator or on a GPU
(docs/fuzz-your-offloader.md)::

    python -m pytest fuzz --offloader examples/engine_offloaders.py:store_without_compute_event
    python -m pytest fuzz --offloader examples/engine_offloaders.py:load_waits_forward --backend cuda
"""

from __future__ import annotations

import functools
import queue
import threading
from collections import Counter, deque
from typing import NamedTuple

import torch

VERDICTS = {
    "store_without_compute_event": "racy",
    "store_after_compute_event": "race-free",
    "load_unfenced": "racy",
    "load_waits_forward": "race-free",
    "load_acked_on_issue": "racy",
    "load_acked_on_event": "race-free",
    "host_lock_released_on_issue": "racy",
    "host_lock_held_until_loaded": "race-free",
    "staging_freed_on_return": "racy",
    "staging_freed_after_event": "race-free",
    "copy_thread_without_compute_event": "racy",
    "copy_thread_after_compute_event": "race-free",
    "report_without_end_query": "racy",
    "report_after_end_query": "race-free",
    "report_on_start_query": "racy",
}


def _layers(cache, host_pool) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
    """(device tensor, host tensor, K/V outermost) per KV tensor, each shared tensor once, as an
    engine's handler pairs its GPU and CPU caches."""
    pairs, seen = [], set()
    for spec in cache.spec.tensors:
        device = cache.layer_tensors[spec.layers[0]]
        if device.data_ptr() in seen:
            continue
        seen.add(device.data_ptr())
        pairs.append((device, host_pool.layer_tensors[spec.layers[0]], spec.kv_outer))
    return pairs


def _rows(tensor: torch.Tensor, kv_outer: bool, block: int, ratio: int) -> torch.Tensor:
    """The kernel-block rows of logical block ``block`` (``ratio`` kernel blocks per block)."""
    first = block * ratio
    return tensor[:, first:first + ratio] if kv_outer else tensor[first:first + ratio]


def _planes(tensor: torch.Tensor, kv_outer: bool, block: int, ratio: int) -> list[torch.Tensor]:
    """Logical block ``block``'s rows as views of one run of memory each: its K and its V rows of a
    K/V-outermost tensor, its rows of a block-outermost one."""
    rows = _rows(tensor, kv_outer, block, ratio)
    return list(rows) if kv_outer else [rows]


class CpuOffloadHandler:
    """Stores and loads on one stream per direction, a CUDA event per job, reported once it has
    completed (vLLM's ``transfer_async`` / ``get_finished``). The flags choose the waits."""

    def __init__(self, cache, host_pool, runtime=None, *, store_waits_compute: bool = True,
                 load_waits_forward: bool = True, ack_on_issue: bool = False) -> None:
        self.pairs = _layers(cache, host_pool)
        self.ratio = cache.spec.block_size // cache.spec.kernel_block_size
        self.store_stream = torch.cuda.Stream()
        self.load_stream = torch.cuda.Stream()
        self.store_waits_compute = store_waits_compute
        self.load_waits_forward = load_waits_forward
        self.ack_on_issue = ack_on_issue
        self.in_flight: deque[tuple[int, torch.cuda.Event]] = deque()
        self.acked: list[int] = []

    def _after_current_stream(self, stream: torch.cuda.Stream) -> None:
        compute_done = torch.cuda.Event()
        compute_done.record(torch.cuda.current_stream())
        stream.wait_event(compute_done)

    def store(self, job_id: int, block_ids: list[int], slot_ids: list[int]) -> None:
        if self.store_waits_compute:  # vLLM #46278: the blocks' writes are queued on the compute stream
            self._after_current_stream(self.store_stream)
        with torch.cuda.stream(self.store_stream):
            for block, slot in zip(block_ids, slot_ids):
                for device, host, kv_outer in self.pairs:
                    _rows(host, kv_outer, slot, self.ratio).copy_(_rows(device, kv_outer, block, self.ratio), non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        self.in_flight.append((job_id, done))

    def load(self, job_id: int, slot_ids: list[int], block_ids: list[int]) -> None:
        if self.load_waits_forward:  # SGLang #36738: the blocks' last tenant ran on the forward stream
            self._after_current_stream(self.load_stream)
        with torch.cuda.stream(self.load_stream):
            for slot, block in zip(slot_ids, block_ids):
                for device, host, kv_outer in self.pairs:
                    _rows(device, kv_outer, block, self.ratio).copy_(_rows(host, kv_outer, slot, self.ratio), non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        if self.ack_on_issue:  # SGLang #27444: the host pages are released when the load starts
            self.acked.append(job_id)
        else:
            self.in_flight.append((job_id, done))

    def wait(self, job_ids: set[int]) -> None:
        """Block until those jobs have finished (vLLM's ``wait``)."""
        for job_id, done in self.in_flight:
            if job_id in job_ids:
                done.synchronize()

    def get_finished(self) -> list[tuple[int, bool]]:
        finished = [(job_id, True) for job_id in self.acked]
        self.acked = []
        still = deque()
        for job_id, done in self.in_flight:
            if done.query():
                finished.append((job_id, True))
            else:
                still.append((job_id, done))
        self.in_flight = still
        return finished

    def close(self) -> None:
        self.store_stream.synchronize()
        self.load_stream.synchronize()


class HostLockedLoads(CpuOffloadHandler):
    """Loads whose host slots are locked against eviction while they are read, as SGLang's radix
    cache locks a node's host pages (``protect_host``, ``inc_host_lock_ref``) for a load-back:
    ``evict(slot_ids)`` frees slots no lock holds and keeps the others (SGLang's host eviction skips
    locked pages). A load is reported once its event has completed either way; ``unlock_on_issue``
    releases its lock as soon as it is queued (SGLang #27444 in ``UnifiedRadixCache.load_back``,
    #31427 in ``HiRadixCache.load_back``), so the caller may free and refill a slot mid-load."""

    def __init__(self, cache, host_pool, runtime=None, *, unlock_on_issue: bool) -> None:
        super().__init__(cache, host_pool)
        self.unlock_on_issue = unlock_on_issue
        self.host_locks: Counter[int] = Counter()
        self.locked_by: dict[int, list[int]] = {}  # load job -> the slots it holds until reported

    def load(self, job_id: int, slot_ids: list[int], block_ids: list[int]) -> None:
        self.host_locks.update(slot_ids)
        self._after_current_stream(self.load_stream)
        with torch.cuda.stream(self.load_stream):
            for slot, block in zip(slot_ids, block_ids):
                for device, host, kv_outer in self.pairs:  # K and V apart, as SGLang copies them: each
                    # plane's rows are one run of pinned memory, so the copy reads the slot as it runs
                    for gpu, cpu in zip(_planes(device, kv_outer, block, self.ratio), _planes(host, kv_outer, slot, self.ratio)):
                        gpu.copy_(cpu, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        self.in_flight.append((job_id, done))
        if self.unlock_on_issue:  # SGLang #27444: the lock covered the queuing, not the copy
            self.host_locks.subtract(slot_ids)
        else:
            self.locked_by[job_id] = list(slot_ids)

    def get_finished(self) -> list[tuple[int, bool]]:
        finished = super().get_finished()
        for job_id, _ in finished:
            self.host_locks.subtract(self.locked_by.pop(job_id, []))
        return finished

    def evict(self, slot_ids: list[int]) -> bool:
        """Free ``slot_ids`` unless a load still holds one of them."""
        return not any(self.host_locks[slot] > 0 for slot in slot_ids)


class StagedLoadOffloader(CpuOffloadHandler):
    """Loads that stage each block through a pinned temporary from a small pool of its own (one
    pinned tensor carved into slots with a free list, as LMCache's allocator does): host slot ->
    temporary on the host, then temporary -> device without blocking."""

    POOL = 2

    def __init__(self, cache, host_pool, runtime=None, *, free_on_return: bool) -> None:
        super().__init__(cache, host_pool)
        self.free_on_return = free_on_return
        self.block_bytes = [(_rows(host, kv_outer, 0, self.ratio), kv_outer) for _, host, kv_outer in self.pairs]
        self.temps = [[torch.empty_like(rows, pin_memory=True) for rows, _ in self.block_bytes] for _ in range(self.POOL)]
        self.free_temps = list(range(self.POOL))
        self.temps_in_use: deque[tuple[torch.cuda.Event, list[int]]] = deque()

    def _take_temp(self) -> int:
        if not self.free_temps:  # every temporary is under a copy: wait for the oldest
            done, temps = self.temps_in_use.popleft()
            done.synchronize()
            self.free_temps.extend(temps)
        return self.free_temps.pop()

    def _return_finished_temps(self) -> None:
        while self.temps_in_use and self.temps_in_use[0][0].query():
            self.free_temps.extend(self.temps_in_use.popleft()[1])

    def load(self, job_id: int, slot_ids: list[int], block_ids: list[int]) -> None:
        self._return_finished_temps()
        self._after_current_stream(self.load_stream)
        taken = []
        with torch.cuda.stream(self.load_stream):
            for slot, block in zip(slot_ids, block_ids):
                temp = self._take_temp()
                taken.append(temp)
                for (device, host, kv_outer), staging in zip(self.pairs, self.temps[temp]):
                    staging.copy_(_rows(host, kv_outer, slot, self.ratio))  # on the host, now
                    _rows(device, kv_outer, block, self.ratio).copy_(staging, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        self.in_flight.append((job_id, done))
        if self.free_on_return:  # LMCache #4830: the copies above may still be reading them
            self.free_temps.extend(taken)
        else:
            self.temps_in_use.append((done, taken))


class CopyThreadOffloader:
    """Copies issued by a background thread fed by a ``queue.SimpleQueue`` (vLLM's SimpleCPUOffload
    shape), on low-priority streams, each job timed by two events from a pool."""

    def __init__(self, cache, host_pool, runtime=None, *, store_waits_compute: bool = True) -> None:
        self.pairs = _layers(cache, host_pool)
        self.ratio = cache.spec.block_size // cache.spec.kernel_block_size
        lowest, _ = torch.cuda.Stream.priority_range()
        self.store_stream = torch.cuda.Stream(priority=lowest)
        self.load_stream = torch.cuda.Stream(priority=lowest)
        self.store_waits_compute = store_waits_compute
        self.timers = deque((torch.Event(enable_timing=True), torch.Event(enable_timing=True)) for _ in range(4))
        self.issued: dict[int, threading.Event] = {}
        self.in_flight: list[tuple[int, torch.Event, torch.Event]] = []  # appended by the copy thread
        self.transfer_ms: list[float] = []  # the metric engines report
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._copy_loop, name="kv-copy", daemon=True)
        self.thread.start()

    def _timer(self) -> tuple[torch.Event, torch.Event]:
        if not self.timers:  # every pair times a job still in flight: a fresh pair
            return torch.Event(enable_timing=True), torch.Event(enable_timing=True)
        return self.timers.popleft()

    def _submit(self, job_id: int, store: bool, pairs: list[tuple[int, int]], waits: bool) -> None:
        after = None
        if waits:  # vLLM #46278: the blocks' writes are queued on the compute stream
            after = torch.Event()
            after.record(torch.cuda.current_stream())
        self.issued[job_id] = threading.Event()
        self.jobs.put((job_id, store, pairs, after, self._timer()))

    def store(self, job_id: int, block_ids: list[int], slot_ids: list[int]) -> None:
        self._submit(job_id, True, list(zip(block_ids, slot_ids)), self.store_waits_compute)

    def load(self, job_id: int, slot_ids: list[int], block_ids: list[int]) -> None:
        self._submit(job_id, False, list(zip(block_ids, slot_ids)), True)

    def _copy_loop(self) -> None:
        while True:
            item = self.jobs.get()
            if item is None:
                return
            job_id, store, pairs, after, (start, end) = item
            stream = self.store_stream if store else self.load_stream
            if after is not None:
                stream.wait_event(after)
            start.record(stream)
            with torch.cuda.stream(stream):
                for block, slot in pairs:
                    for device, host, kv_outer in self.pairs:
                        gpu, cpu = _rows(device, kv_outer, block, self.ratio), _rows(host, kv_outer, slot, self.ratio)
                        (cpu.copy_(gpu, non_blocking=True) if store else gpu.copy_(cpu, non_blocking=True))
            end.record(stream)
            self.in_flight.append((job_id, start, end))
            self.issued[job_id].set()

    def wait(self, job_ids: set[int]) -> None:
        for job_id in job_ids:
            self.issued[job_id].wait()
        for job_id, _, end in list(self.in_flight):
            if job_id in job_ids:
                end.synchronize()

    def get_finished(self) -> list[tuple[int, bool]]:
        finished, still = [], []
        for job_id, start, end in self.in_flight:
            if end.query():
                self.transfer_ms.append(start.elapsed_time(end))
                self.timers.append((start, end))
                self.issued.pop(job_id, None)
                finished.append((job_id, True))
            else:
                still.append((job_id, start, end))
        self.in_flight = still
        return finished

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join()
        self.store_stream.synchronize()
        self.load_stream.synchronize()


class TransferResult(NamedTuple):
    """vLLM's ``TransferResult``: the job, whether it succeeded, and the metrics it reports."""

    job_id: int
    success: bool
    transfer_size: int  # bytes
    transfer_time: float  # seconds


class _Transfer(NamedTuple):
    job_id: int
    stream: torch.cuda.Stream
    start_event: torch.Event
    end_event: torch.Event
    num_bytes: int


class TimedTransferHandler:
    """vLLM's CPU offloading handler shape: ``transfer_async(job_id, (src, dst))`` on a stream from a
    pool, timed by two events from a pool, and ``get_finished()`` reporting each job with its
    transfer time, oldest first. ``query=None`` reports every queued job without asking its end
    event whether the copies have run; ``query="start"`` asks the start event instead, which the
    stream passes before the copies."""

    def __init__(self, cache, host_pool, runtime=None, *, query: str | None = "end") -> None:
        self.pairs = _layers(cache, host_pool)
        self.ratio = cache.spec.block_size // cache.spec.kernel_block_size
        self.query = query
        self.block_bytes = sum(_rows(device, kv_outer, 0, self.ratio).nbytes for device, _, kv_outer in self.pairs)
        self._transfers: deque[_Transfer] = deque()
        self._stream_pool: list[torch.cuda.Stream] = []
        self._event_pool: list[torch.Event] = []

    def transfer_async(self, job_id: int, spec) -> bool:
        src_spec, dst_spec = spec
        store = src_spec.medium() == "GPU"
        stream = self._stream_pool.pop() if self._stream_pool else torch.cuda.Stream()
        start_event = self._event_pool.pop() if self._event_pool else torch.Event(enable_timing=True)
        end_event = self._event_pool.pop() if self._event_pool else torch.Event(enable_timing=True)
        # A store reads what the forward wrote, a load overwrites blocks the forward may still read:
        # both start after the compute stream's queued work (vLLM #46278).
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            start_event.record(stream)
            for src, dst in zip(src_spec.block_ids.tolist(), dst_spec.block_ids.tolist()):
                block, slot = (src, dst) if store else (dst, src)
                for device, host, kv_outer in self.pairs:
                    gpu, cpu = _rows(device, kv_outer, block, self.ratio), _rows(host, kv_outer, slot, self.ratio)
                    (cpu.copy_(gpu, non_blocking=True) if store else gpu.copy_(cpu, non_blocking=True))
            end_event.record(stream)
        self._transfers.append(_Transfer(job_id, stream, start_event, end_event,
                                         len(dst_spec.block_ids) * self.block_bytes))
        return True

    def _done(self, transfer: _Transfer) -> bool:
        if self.query is None:
            return True
        return (transfer.start_event if self.query == "start" else transfer.end_event).query()

    def get_finished(self) -> list[TransferResult]:
        results = []
        while self._transfers and self._done(self._transfers[0]):
            transfer = self._transfers.popleft()
            # The racy twin reaches this with the copies still queued: CUDA refuses to time an end
            # event that has not completed, and the report surfaces as that error.
            seconds = transfer.start_event.elapsed_time(transfer.end_event) * 1e-3  # elapsed_time is in ms
            results.append(TransferResult(transfer.job_id, True, transfer.num_bytes, seconds))
            self._stream_pool.append(transfer.stream)
            self._event_pool.extend((transfer.end_event, transfer.start_event))
        return results

    def wait(self, job_ids: set[int]) -> None:
        for transfer in self._transfers:
            if transfer.job_id in job_ids:
                transfer.end_event.synchronize()

    def close(self) -> None:
        for transfer in self._transfers:
            transfer.end_event.synchronize()


# The factories (cache, host_pool, runtime): each racy one beside its race-free twin.
store_without_compute_event = functools.partial(CpuOffloadHandler, store_waits_compute=False)
store_after_compute_event = functools.partial(CpuOffloadHandler)
load_unfenced = functools.partial(CpuOffloadHandler, load_waits_forward=False)
load_waits_forward = functools.partial(CpuOffloadHandler)
load_acked_on_issue = functools.partial(CpuOffloadHandler, ack_on_issue=True)
load_acked_on_event = functools.partial(CpuOffloadHandler)
host_lock_released_on_issue = functools.partial(HostLockedLoads, unlock_on_issue=True)
host_lock_held_until_loaded = functools.partial(HostLockedLoads, unlock_on_issue=False)
staging_freed_on_return = functools.partial(StagedLoadOffloader, free_on_return=True)
staging_freed_after_event = functools.partial(StagedLoadOffloader, free_on_return=False)
copy_thread_without_compute_event = functools.partial(CopyThreadOffloader, store_waits_compute=False)
copy_thread_after_compute_event = functools.partial(CopyThreadOffloader)
report_without_end_query = functools.partial(TimedTransferHandler, query=None)
report_after_end_query = functools.partial(TimedTransferHandler)
report_on_start_query = functools.partial(TimedTransferHandler, query="start")
