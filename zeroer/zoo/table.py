"""Zoo family 4: the segment address table (what to zero, and where it lives).

vLLM's constructor turns the KV tensors into a table of segments, each an absolute address, a
block stride and a page span (vLLM #35219; stride and span apart since #50276). These entries
get the table wrong: a page span taken from the stride of a packed view, a shared tensor's second
half left out, and a table captured once and kept after the cache moved. Like family 3 they
stage ids race-free and zero through the torch model of the kernel (:mod:`zeroer.zoo.kernel_model`).

Example::

    z = PackedOverrun(cache, rt)              # geometry "packed": rows padded past their pages
    z.zero_block_ids([1])                     # also clears the padding and the next page
"""

from __future__ import annotations

import torch

from zeroer.cache.layout import KVCache
from kvdevice.runtime import Runtime
from zeroer.zoo.entry import ZooEntry, allocate, start
from zeroer.zoo.kernel_model import KernelModelZeroer, SegmentWords, segment_words, store_zeros


class PackedOverrun(ZooEntry, KernelModelZeroer):
    """A packed view zeroed over its whole block stride instead of its page span.

    In packed layouts (DeepSeek-V4 ``fp8_ds_mla``, ``KVCacheLayout.BLHNC`` views) a block's row
    is longer than the page the attention layer owns; the table must zero ``page`` words per
    block, not ``block_stride``. vLLM **#50276** separated the two after the kernel zeroed past
    the page: the padding, the next split's page and, for the last block, bytes past the
    allocation (``cudaErrorIllegalAddress`` far from the cause). Symptom (#43990 comment, #52709):
    packed DSV4 layouts wiped an indexer block per request, "identical requests return different
    text", depending on allocation order ("looks like kernel nondeterminism"). Past the end of
    the buffer the model clamps its stores onto the last guard word instead of faulting.
    """

    name = "zoo.packed_overrun"
    geometry = "packed"
    upstream = "vLLM #50276 (block stride vs page span)"
    scenario = (start(), allocate(1))

    def zero_segments(self, ids: torch.Tensor) -> None:
        for seg in self.segments():
            store_zeros(seg, ids, stride=seg.stride, width=seg.stride)  # the bug: stride, not page


class SharedKOnly(ZooEntry, KernelModelZeroer):
    """A KV tensor shared by several layers gets only its K segment; its V pages stay stale.

    A tensor bound to several layers (``KVCacheTensor.shared_by``: here an attention layer and a
    linear-attention layer of a hybrid model over one raw buffer) must be zeroed once and fully
    (docs/contract.md, promise 1). This table takes the layout from the first view that reaches
    the tensor as if it were block-outer (one segment where the K/V-outer attention view needs
    two), and the de-duplication by ``data_ptr`` then skips the view that would have added V.
    Unshared tensors are unaffected. The upstream analogs are the ``seen_ptrs`` de-duplication
    of #35219 and the per-group / shared-storage fixes of #52187 and #52709; no issue reported
    this exact case. Symptom: half of every new block (the V cache) keeps the previous tenant's
    fp32 state: NaN in hybrid models only, and only in the layers that share a buffer.
    """

    name = "zoo.shared_k_only"
    geometry = "shared_layers"
    upstream = "hazard 15: shared_by de-duplication (#35219 seen_ptrs; #52187, #52709)"
    scenario = (start(), allocate(1))

    def segments(self) -> list[SegmentWords]:
        tensors = self.cache.spec.tensors
        return [s for s in segment_words(self.cache) if len(tensors[s.segment.tensor_index].layers) == 1 or s.segment.part == 0]


class StaleTable(ZooEntry, KernelModelZeroer):
    """The address table captured once, and used after the KV cache was reallocated.

    vLLM builds its table of absolute addresses once, in the constructor, and relies on the
    cache never moving: the zeroer's own tensors live outside the CuMem pool "so the bookkeeping
    GPU tensors are not discarded during sleep/wake", and sleep/wake preserves virtual addresses
    (the worker init of vLLM #35219; docs/contract.md, "Where this project refines it"). If the
    cache is reallocated anyway (a resize, a re-initialisation, a sleep mode that frees the
    address range), the zeroer keeps zeroing the old memory: new blocks keep their stale bytes
    and freed memory, possibly another allocation by now, is written. No upstream issue; the
    hazard is by design. The model keeps the old buffers alive and zeroes them (a GPU would
    write freed memory); the fuzzer's ``reallocate`` op moves the cache.
    """

    name = "zoo.stale_table"
    upstream = "hazard 19: absolute addresses captured once (note 1.3)"
    scenario = (start(), {"op": "reallocate"}, allocate(1))

    def __init__(self, cache: KVCache, runtime: Runtime, *, kernel: str = "torch") -> None:
        super().__init__(cache, runtime, kernel=kernel)
        self._table = segment_words(cache)  # captured once: the bug

    def segments(self) -> list[SegmentWords]:
        return self._table
