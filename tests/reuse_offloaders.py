"""A KV offloader whose loads scatter through a device index made on the caller's stream
(tests/test_sim_device_reuse.py): SGLang #34076's shape under the fuzzer.

Each load moves its host slots to the device and scatters them into the blocks' kernel-block rows
with ``index_copy_`` on the load stream, through ``device_rows``, an index tensor made on the
caller's stream (as SGLang's ``transfer_kv_per_layer`` takes device indices). The load stream waits
for the caller's stream, so it sees the index; dropped without ``record_stream``, the index's block
goes back to the caller's stream at once, and the next load's index, made there, may be handed it
and written before the load stream's queued ``index_copy_`` has read the old rows. Racy; with
``device_rows.record_stream(load_stream)`` race-free. Stores are vLLM's handler's, after the
compute stream.
"""

from __future__ import annotations

import functools
from collections import deque

import torch


class IndexedLoadOffloader:
    """Stores copy block by block; loads scatter through a device index (see the module docstring)."""

    def __init__(self, cache, host_pool, runtime=None, *, record_stream: bool) -> None:
        self.pairs, seen = [], set()
        for spec in cache.spec.tensors:  # each shared tensor once, as an engine pairs its caches
            device = cache.layer_tensors[spec.layers[0]]
            if device.data_ptr() not in seen:
                seen.add(device.data_ptr())
                self.pairs.append((device, host_pool.layer_tensors[spec.layers[0]], 1 if spec.kv_outer else 0))
        self.ratio = cache.spec.block_size // cache.spec.kernel_block_size
        self.store_stream = torch.cuda.Stream()
        self.load_stream = torch.cuda.Stream()
        self.record_stream = record_stream
        self.in_flight: deque[tuple[int, torch.cuda.Event]] = deque()

    def _rows(self, blocks: list[int]) -> list[int]:
        return [block * self.ratio + r for block in blocks for r in range(self.ratio)]

    def _after_current_stream(self, stream: torch.cuda.Stream) -> None:
        stream.wait_stream(torch.cuda.current_stream())

    def store(self, job_id: int, block_ids: list[int], slot_ids: list[int]) -> None:
        self._after_current_stream(self.store_stream)  # vLLM #46278
        with torch.cuda.stream(self.store_stream):
            for block, slot in zip(block_ids, slot_ids):
                for device, host, dim in self.pairs:
                    rows = slice(slot * self.ratio, (slot + 1) * self.ratio)
                    source = slice(block * self.ratio, (block + 1) * self.ratio)
                    (host[:, rows] if dim else host[rows]).copy_(device[:, source] if dim else device[source],
                                                                 non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        self.in_flight.append((job_id, done))

    def load(self, job_id: int, slot_ids: list[int], block_ids: list[int]) -> None:
        device_rows = torch.tensor(self._rows(block_ids), dtype=torch.int64).to("cuda", non_blocking=True)
        self._after_current_stream(self.load_stream)  # sees the index and the blocks' last use
        with torch.cuda.stream(self.load_stream):
            host_rows = torch.tensor(self._rows(slot_ids), dtype=torch.int64)
            for device, host, dim in self.pairs:
                staged = host.index_select(dim, host_rows).to("cuda", non_blocking=True)
                device.index_copy_(dim, device_rows, staged)  # reads device_rows when the stream gets here
            done = torch.cuda.Event()
            done.record()
        if self.record_stream:  # SGLang #34076's fix: the index is in use on the load stream too
            device_rows.record_stream(self.load_stream)
        self.in_flight.append((job_id, done))

    def wait(self, job_ids: set[int]) -> None:
        for job_id, done in self.in_flight:
            if job_id in job_ids:
                done.synchronize()

    def get_finished(self) -> list[tuple[int, bool]]:
        finished, still = [], deque()
        for job_id, done in self.in_flight:
            (finished.append((job_id, True)) if done.query() else still.append((job_id, done)))
        self.in_flight = still
        return finished

    def close(self) -> None:
        self.store_stream.synchronize()
        self.load_stream.synchronize()


index_dropped_without_record_stream = functools.partial(IndexedLoadOffloader, record_stream=False)
index_record_stream = functools.partial(IndexedLoadOffloader, record_stream=True)
