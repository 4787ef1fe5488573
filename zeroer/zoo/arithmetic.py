"""Zoo family 3: the kernel's arithmetic (offset width, block ratio, grid).

Each entry is :class:`~zeroer.zoo.kernel_model.KernelModelZeroer` (race-free staging, a torch
model of the kernel's stores) with one arithmetic mistake of the kind vLLM's Triton kernel has
had to get right. The upstream analog is the kernel's arithmetic, not its staging; the model
stands in for the Triton code so that the bug runs on the simulator and on CUDA alike.

Example::

    z = RatioIgnored(cache, rt)               # geometry "ratio2": 2 kernel blocks per logical block
    z.zero_block_ids([2])                     # zeroes kernel block 2 (half of logical block 1)
"""

from __future__ import annotations

import torch

from zeroer.cache.layout import KVCache
from zeroer.protocol import Capabilities, IDS_CONTAINERS
from kvdevice.runtime import Runtime
from zeroer.zoo.entry import ZooEntry, allocate, start, write
from zeroer.zoo.kernel_model import KernelModelZeroer, store_zeros

MAX_BLOCK_SIZE = 1024  # int32 words per program at most, as in vLLM's kernel


def calibrated_offset_bits(cache: KVCache) -> int:
    """The offset width at which the upper half of ``cache``'s blocks wrap (at least 2 bits).

    The largest ``b`` with ``2**b <= (num_blocks // 2) * smallest block stride in bytes``.
    """
    stride_bytes = min(seg.block_stride for seg in cache.segments) * 4
    return max(2, (max(1, cache.spec.num_blocks // 2) * stride_bytes).bit_length() - 1)


class Int32Offset(ZooEntry, KernelModelZeroer):
    """Byte offsets computed in too few bits: large block ids wrap onto low ones.

    The kernel computes ``block_id * block_stride`` for a page's offset in its segment. In
    32-bit arithmetic (ids staged as int32 to halve the copy, a 32-bit stride constant), the
    product wraps once a segment passes 4 GiB: the ids at the top of the cache zero pages at its
    bottom, and their own pages keep the previous tenant's bytes. vLLM's kernel computes it in
    64 bits on purpose (since #35219; the address table itself went from int64 to uint64 in
    #37197), and #52058 is the same class of overflow in the grid size.
    Symptom: NaN from unzeroed pages only on large caches (many blocks or huge pages), and live
    KV of low blocks wiped.

    **Scaled model.** A >4 GiB segment is too slow for the CPU simulator, so the offset width is
    a parameter: ``offset_bits`` (bytes wrap modulo ``2**offset_bits``). The default calibrates it
    to the geometry (:func:`calibrated_offset_bits`: the upper half of the blocks wrap; 9 bits on
    ``tiny``), a model of the 32-bit wrap shrunk to a small cache. ``zoo.int32_offset_4gib`` is
    the unscaled one: 32 bits on a 5 GiB segment, cuda only. The model wraps like an unsigned
    32-bit offset, back to the segment's start; a signed int32 offset would wrap at 2 GiB to a
    negative one and write before the segment (an illegal address on a GPU), which the model does
    not do, so that the run goes on and the oracle can name the block.
    """

    name = "zoo.int32_offset"
    upstream = "64-bit offsets of vLLM's kernel (1.5; #37197, #52058 class)"
    scenario = (start(), allocate(3), write(1), allocate(2))  # blocks 4 and 5 wrap onto 0 and 1

    def __init__(self, cache: KVCache, runtime: Runtime, *, offset_bits: int | None = None, kernel: str = "torch") -> None:
        super().__init__(cache, runtime, kernel=kernel)
        if offset_bits is None:
            offset_bits = calibrated_offset_bits(cache)
        if not isinstance(offset_bits, int) or not 2 <= offset_bits <= 64:
            raise ValueError(f"offset_bits={offset_bits!r} must be an int between 2 and 64 (32 models int32)")
        self.offset_bits = offset_bits
        self.wrap_words = 2**offset_bits // 4

    def zero_segments(self, ids: torch.Tensor) -> None:
        num_blocks = self.cache.spec.num_blocks
        for seg in self.segments():
            if self.wrap_words % seg.stride == 0:
                # Whole pages wrap: index page rows (cheap on 512 MiB pages, no per-word index).
                rows = min(self.wrap_words // seg.stride, num_blocks)
                pages = seg.raw.as_strided((rows, seg.page), (seg.stride, 1), seg.base)
                pages.index_fill_(0, torch.remainder(ids.to(torch.int64), self.wrap_words // seg.stride), 0)
            else:
                store_zeros(seg, ids, stride=seg.stride, width=seg.page, wrap_words=self.wrap_words)


class Int32Offset4GiB(Int32Offset):
    """``zoo.int32_offset`` unscaled: a 32-bit offset on a 5 GiB segment (cuda only).

    The same bug and upstream analogs (the 64-bit offsets of vLLM's kernel, #37197, #52058).

    Geometry ``int32_wrap``: ten 512 MiB pages in one segment; blocks 8 and 9 sit past 4 GiB and
    wrap onto blocks 0 and 1. Too big for the simulator (and for the CPU CI); run it with
    ``python -m fuzz.bench.detect --backend cuda --entries zoo.int32_offset_4gib``.
    """

    name = "zoo.int32_offset_4gib"
    geometry = "int32_wrap"
    capabilities = Capabilities(api="runtime", ids_as=IDS_CONTAINERS, backends=("cuda",), follows_reallocation=True)
    scenario = (start(), allocate(3), allocate(3), allocate(3))  # the third call's 8 and 9 wrap

    def __init__(self, cache: KVCache, runtime: Runtime, *, offset_bits: int = 32, kernel: str = "torch") -> None:
        super().__init__(cache, runtime, offset_bits=offset_bits, kernel=kernel)


class RatioIgnored(ZooEntry, KernelModelZeroer):
    """The logical-to-kernel block ratio ignored: logical block ``b`` zeroed as kernel block ``b``.

    With virtual block splitting a scheduler block covers ``ratio`` kernel blocks
    (``ratio = spec.block_size // kernel_block_size``; logical block ``b`` is kernel blocks
    ``b*ratio .. b*ratio + ratio - 1``), and vLLM's constructor multiplies the page by the ratio
    (``page_size_el = kernel_block_el * ratio``). Forgetting it zeroes one kernel page at
    ``b * kernel_page``: half of logical block ``b // 2`` when ratio is 2, the wrong block's data
    wiped, and ``b``'s own pages left stale. The upstream analog is that line
    of the constructor, there since the zeroer's introduction in vLLM #35219; no issue reported
    this exact bug. Symptom: NaN in models whose attention
    backend uses a smaller kernel block than the scheduler (FlashInfer/TRT-LLM kernel block 16 or
    32 under a 64-token manager block, and hybrid models, which pick large logical blocks).
    """

    name = "zoo.ratio_ignored"
    geometry = "ratio2"
    upstream = "page_size_el = kernel_block_el * ratio (#35219 constructor, note 1.4)"
    scenario = (start(), allocate(2))

    def zero_segments(self, ids: torch.Tensor) -> None:
        ratio = self.cache.spec.ratio
        for seg in self.segments():
            kernel_stride = seg.stride // ratio  # the bug: one kernel block per logical block
            store_zeros(seg, ids, stride=kernel_stride, width=min(seg.page, kernel_stride))


class LastChunkSkipped(ZooEntry, KernelModelZeroer):
    """Grid off by one: the last chunk of every page is never zeroed.

    vLLM's kernel tiles a page into chunks of ``BLOCK_SIZE`` int32 words (the largest power of two
    dividing the page, at most 1024) and launches one program per chunk. Computing the chunk
    count as ``(page - 1) // BLOCK_SIZE`` (a ceil-division written one short) instead of
    ``page // BLOCK_SIZE`` leaves the last chunk of every page stale. On DeepSeek-V3.2 pages
    (10,496 and 2,112 words, geometry ``mla_indexer``) that is the last 256 and 64 words. The
    upstream analog is the chunk and grid arithmetic that #49704 (non-uniform pages, programs past
    a segment's page exit early) and #52058 (bounded 3-D grid) rewrote; no issue reported this
    exact off-by-one. Symptom: NaN from the tail of a page, i.e. only for requests whose last
    tokens in a block land there; the null block 0 itself stays dirty (cf. #57158).
    """

    name = "zoo.last_chunk_skipped"
    geometry = "mla_indexer"
    upstream = "chunk/grid arithmetic rewritten in #49704 / #52058"
    scenario = (start(), allocate(1))

    def zero_segments(self, ids: torch.Tensor) -> None:
        for seg in self.segments():
            chunk = min(seg.page & -seg.page, MAX_BLOCK_SIZE)
            chunks = (seg.page - 1) // chunk  # the bug: one chunk short when chunk divides the page
            store_zeros(seg, ids, stride=seg.stride, width=chunks * chunk)
