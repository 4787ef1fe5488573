"""Zeroers that break the contract in one way each, where an earlier harness never looked.

Each is race-free in every other respect (they stage like ``per_call``/``reference``), so the
campaign that finds it shows the harness now exercises that part of the contract
(tests/test_contract_gaps.py). ``ExactPages`` is the race-free control.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from zeroer.designs import PerCallZeroer, validate_block_ids
from zeroer.kernel import zero_blocks_reference
from zeroer.protocol import Capabilities

RUNTIME = Capabilities(api="runtime", follows_reallocation=True)


class KeepsCallersIds:
    """Reads the caller's id container when its kernel runs, not when it is called (promise 3).

    A copy of the list would be right; this closure keeps the container itself, so a caller that
    reuses it for its next step zeroes whatever it now holds.
    """

    capabilities = RUNTIME

    def __init__(self, cache, runtime) -> None:
        self.cache, self.rt = cache, runtime
        self.num_blocks = cache.spec.num_blocks

    def zero_block_ids(self, block_ids) -> None:
        ids = validate_block_ids(block_ids, self.num_blocks)  # checked now...
        if not ids:
            return
        cache, kept = self.cache, block_ids  # ...but the container is what the kernel reads

        def run() -> None:
            zero_blocks_reference(cache, [int(b) for b in kept])

        self.rt.launch(run, name="zero_kept_ids", blocks_written=ids)


class SharedStaging(PerCallZeroer):
    """One pinned staging buffer shared by every instance (a class attribute), rewritten by each.

    Alone, each instance waits for its own previous copy (an event per instance); two instances
    in one process (one per KV-cache group, as an engine builds them) rewrite each other's ids.
    """

    capabilities = RUNTIME
    _shared: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # runtime -> (host, device) buffers

    def __init__(self, cache, runtime, kernel: str = "torch") -> None:
        super().__init__(cache, runtime, kernel=kernel)
        self._done = None

    def zero_block_ids(self, block_ids) -> None:
        ids = self._validate(block_ids)
        if not ids:
            return
        if self.rt not in SharedStaging._shared:
            SharedStaging._shared[self.rt] = (self.rt.host_buffer(64), self.rt.device_buffer(64, name="shared ids"))
        host, dev = SharedStaging._shared[self.rt]
        with self.rt.annotate(self._origin(ids)):
            if self._done is not None:
                self.rt.synchronize_event(self._done)  # its own previous call only
            self.rt.write_host(host, ids)
            self.rt.copy_h2d(dev, host, len(ids))
            self._launch_zero(dev, len(ids), ids)
            self._done = self.rt.record_event()


class UniformPages(PerCallZeroer):
    """Zeroes every segment with segment 0's page size and stride (uniform pages assumed, the
    assertion vLLM dropped in #49704): wrong on caches with non-uniform pages or strides."""

    capabilities = RUNTIME

    def __init__(self, cache, runtime, kernel: str = "torch") -> None:
        super().__init__(cache, runtime, kernel=kernel)

    def _launch_zero(self, dev, n, ids) -> None:
        view, cache = dev.tensor[:n], self.cache
        first = cache.segments[0]

        def run() -> None:
            for s in range(len(cache.segments)):
                pages = cache.pages(s)
                raw = pages.as_strided((cache.spec.num_blocks, first.page), (first.block_stride, 1), pages.storage_offset())
                raw.index_fill_(0, view.to(torch.int64), 0)

        self.rt.launch(run, name="zero_uniform", reads=[dev], blocks_written=ids)


class DeepRing(PerCallZeroer):
    """A ring of 4 persistent staging pairs without events: safe until 5 calls are outstanding."""

    capabilities = RUNTIME
    DEPTH = 4

    def __init__(self, cache, runtime, kernel: str = "torch") -> None:
        super().__init__(cache, runtime, kernel=kernel)
        self._slots = [(runtime.host_buffer(64), runtime.device_buffer(64, name=f"deep ring slot {i}"))
                       for i in range(self.DEPTH)]
        self._next = itertools.count()

    def zero_block_ids(self, block_ids) -> None:
        ids = self._validate(block_ids)
        if not ids:
            return
        host, dev = self._slots[next(self._next) % self.DEPTH]
        with self.rt.annotate(self._origin(ids)):
            self.rt.write_host(host, ids)
            self.rt.copy_h2d(dev, host, len(ids))
            self._launch_zero(dev, len(ids), ids)


class ExactPages(PerCallZeroer):
    """The control: per_call's staging, declared like the others. Race-free."""

    capabilities = RUNTIME

    def __init__(self, cache, runtime, kernel: str = "torch") -> None:
        super().__init__(cache, runtime, kernel=kernel)
