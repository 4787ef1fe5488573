"""A torch model of the zero kernel's stores, for zoo entries whose bug is in its arithmetic.

The Triton kernel (``zeroer/kernel.py``, vLLM's ``_zero_kv_blocks_kernel``) stores int32 zeros at
``segment address + block_id * block_stride + column`` for every column of the page. Bugs in that
arithmetic (a page span, a stride, a grid, an offset width) are modelled here in torch over the
same segment table, so they run on the CPU simulator and on CUDA alike: like the kernel, the
model reads the block ids from device memory when the stream runs it, and it issues no host
synchronisation (it would hang behind a gate of the controlled cuda runtime).

:class:`KernelModelZeroer` stages ids race-free (a fresh protected pinned buffer per call, vLLM
after #48399) and launches :meth:`KernelModelZeroer.zero_segments` on the current stream.
Without a bug it zeroes exactly what the real kernel does (``tests/test_zoo.py`` checks that);
each zoo entry overrides one piece of it.

Example::

    z = KernelModelZeroer(cache, rt)          # the exact model: no bug
    z.zero_block_ids([1, 3])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zeroer.designs import PerCallZeroer
from zeroer.cache.layout import WORD_BYTES, KVCache, Segment
from kvdevice.runtime import DeviceBuffer, Runtime


@dataclass(frozen=True)
class SegmentWords:
    """One row of the address table, resolved to the raw int32 buffer it points into."""

    raw: torch.Tensor  # the whole int32 buffer of the segment's tensor, guards included
    base: int  # word offset of block 0's page in ``raw`` (the table's address, relative)
    stride: int  # words from one logical block to the next
    page: int  # words to zero per logical block
    segment: Segment


def segment_words(cache: KVCache) -> list[SegmentWords]:
    """The cache's address table as the model reads it (built from ``cache.segments`` now)."""
    rows = []
    for seg in cache.segments:
        raw = cache.raws[seg.tensor_index]
        rows.append(SegmentWords(raw, (seg.addr - raw.data_ptr()) // WORD_BYTES, seg.block_stride, seg.page, seg))
    return rows


def store_zeros(seg: SegmentWords, ids: torch.Tensor, *, stride: int, width: int, wrap_words: int | None = None) -> None:
    """Zero words ``base + ((id * stride + c) mod wrap_words)`` for ``c`` in ``0..width-1``.

    A store that would leave the raw buffer is clamped onto its first or last word (a guard word,
    so the oracle reports it): on a GPU it would be an out-of-bounds write, which the model must
    not do to keep the process alive.
    """
    if width <= 0:
        return
    cols = torch.arange(width, dtype=torch.int64, device=ids.device)
    offsets = ids.to(torch.int64)[:, None] * stride + cols[None, :]
    if wrap_words is not None:
        offsets = torch.remainder(offsets, wrap_words)
    index = (offsets + seg.base).reshape(-1).clamp_(0, seg.raw.numel() - 1)
    seg.raw.index_fill_(0, index, 0)


class KernelModelZeroer(PerCallZeroer):
    """Race-free staging plus the torch model of the kernel; subclasses plant one bug."""

    name = "kernel_model"

    def __init__(self, cache: KVCache, runtime: Runtime, *, kernel: str = "torch") -> None:
        if kernel != "torch":
            raise ValueError(
                f"{self.name} models the zero kernel in torch to plant its bug; kernel={kernel!r} is "
                f"not available, use kernel='torch'"
            )
        super().__init__(cache, runtime, kernel="torch")

    def segments(self) -> list[SegmentWords]:
        """The address table the kernel reads: the cache's current one."""
        return segment_words(self.cache)

    def zero_segments(self, ids: torch.Tensor) -> None:
        """The kernel's stores: the exact page of every id in every segment."""
        for seg in self.segments():
            store_zeros(seg, ids, stride=seg.stride, width=seg.page)

    def _launch_zero(self, dev: DeviceBuffer, n: int, ids: list[int]) -> None:
        view = dev.tensor[:n]
        self.rt.launch(lambda: self.zero_segments(view), name="zero_kernel_model", reads=[dev], blocks_written=ids)
