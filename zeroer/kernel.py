"""The Triton zero kernel, its launcher, and a pure-torch reference to check it against.

The model. The kernel reads an address table of segments (see `zeroer.layout`): for every
requested logical block `b` and every segment `s` it stores int32 zeros over
`[addr_s + b * block_stride_s * 4, + page_s * 4)` bytes, in chunks of BLOCK_SIZE words, with
masked stores so a chunk never runs past a page that is shorter than its stride (vLLM #50276).
All three grid axes are grid-stride loops, so any grid covers all the work and the launch stays
within CUDA's limits however many blocks, segments and chunks there are (vLLM #52058).

One Python function is used twice: compiled with `triton.jit` for CUDA tensors, and run by
Triton's interpreter for CPU tensors, in the same process (CI has no GPU; we do not rely on the
TRITON_INTERPRET environment variable). Under that interpreter Triton's @jit'd stdlib helpers
(`tl.zeros`...) fail, so the kernel uses builtins only.

`zero_blocks_reference` zeroes the same words with plain torch indexing, from the spec's
geometry alone and never from the segment table, so comparing the two checks both the table and
the kernel.

Example:

    >>> import torch
    >>> from zeroer.geometries import geometry
    >>> from zeroer.layout import build_cache
    >>> kernel_cache, ref_cache = build_cache(geometry("tiny")), build_cache(geometry("tiny"))
    >>> zero_blocks(kernel_cache.table, torch.tensor([1, 5], dtype=torch.int64))
    >>> zero_blocks_reference(ref_cache, [1, 5])
    >>> all(torch.equal(a, b) for a, b in zip(kernel_cache.raws, ref_cache.raws))
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from zeroer.errors import RuntimeUsageError
from zeroer.layout import device_index

if TYPE_CHECKING:
    from zeroer.layout import KVCache, SegmentTable

MAX_BLOCK_SIZE = 1024  # int32 words one program stores per chunk
CUDA_MAX_GRID_X = 2**31 - 1  # CUDA limit on gridDim.x
CUDA_MAX_GRID_YZ = 65535  # CUDA limit on gridDim.y and gridDim.z


def _zero_kv_blocks(
    seg_addrs_ptr,  # int64[n_segs]: byte address of block 0's page in each segment
    seg_block_strides_ptr,  # int64[n_segs]: int32 words from one logical block to the next
    seg_pages_ptr,  # int64[n_segs]: int32 words to zero per logical block
    block_ids_ptr,  # int64[n_blocks]: logical block ids to zero
    n_blocks,  # number of ids
    n_segs,  # number of segments
    max_chunks,  # ceil(max page / BLOCK_SIZE)
    BLOCK_SIZE: tl.constexpr,  # int32 words per chunk, a power of two
):
    # Grid-stride loops on every axis: a grid clamped to CUDA's limits still covers all work
    # (vLLM #52058: 6,870 blocks x 181 segments x 2,336 chunks overflowed a flat grid).
    # `while`, not `range(tl.program_id(0), ...)`: Triton 3.6's interpreter cannot turn a
    # program id into a range() bound under NumPy 2.5 (its __index__ calls int() on a 1-D array).
    i = tl.program_id(0)
    while i < n_blocks:
        # Read when the kernel runs, not when it is enqueued: the value the #48085 race corrupts.
        block_id = tl.load(block_ids_ptr + i).to(tl.int64)
        s = tl.program_id(1)
        while s < n_segs:
            addr = tl.load(seg_addrs_ptr + s).to(tl.int64)
            stride = tl.load(seg_block_strides_ptr + s).to(tl.int64)
            page = tl.load(seg_pages_ptr + s).to(tl.int64)
            # 64-bit byte offsets: block_id * stride * 4 passes 2**31 on big caches.
            base = (addr + block_id * stride * 4).to(tl.pointer_type(tl.int32))
            c = tl.program_id(2)
            while c < max_chunks:
                cols = tl.arange(0, BLOCK_SIZE).to(tl.int64) + c.to(tl.int64) * BLOCK_SIZE
                # Masked: never past a page shorter than its stride (packed views, vLLM #50276).
                tl.store(base + cols, tl.full((BLOCK_SIZE,), 0, tl.int32), mask=cols < page)
                c += tl.num_programs(2)
            s += tl.num_programs(1)
        i += tl.num_programs(0)

_compiled = triton.jit(_zero_kv_blocks, do_not_specialize=["n_blocks", "n_segs", "max_chunks"])
_interpreted = InterpretedFunction(_zero_kv_blocks)


def launch_grid(n_blocks: int, n_segs: int, max_chunks: int,
                device_type: str) -> tuple[int, int, int]:
    """The default grid: one program per (block, segment, chunk), clamped to CUDA's limits.

    On the CPU interpreter every program costs Python overhead, so one program does it all.

    >>> launch_grid(6870, 181, 2336, "cuda")
    (6870, 181, 2336)
    >>> launch_grid(3, 2, 1, "cpu")
    (1, 1, 1)
    """
    if device_type != "cuda":
        return (1, 1, 1)
    return (max(1, min(n_blocks, CUDA_MAX_GRID_X)), max(1, min(n_segs, CUDA_MAX_GRID_YZ)),
            max(1, min(max_chunks, CUDA_MAX_GRID_YZ)))


def zero_blocks(table: SegmentTable, block_ids: torch.Tensor,
                grid: tuple[int, int, int] | None = None) -> None:
    """Zero the pages of `block_ids` in every segment of `table`, on `block_ids`' device.

    `block_ids` must be an int64 1-D tensor on the table's device. Its *values* are not checked
    here (that would cost a device sync per call, and the ids are read only when the kernel runs):
    the caller validates them, as vLLM's scheduler does. An explicit `grid` replaces the default
    (tests use small grids to exercise the grid-stride loops under the interpreter).
    """
    if block_ids.dtype != torch.int64 or block_ids.dim() != 1:
        raise RuntimeUsageError(
            f"block_ids has dtype {block_ids.dtype} and {block_ids.dim()} dims; the kernel reads "
            f"a 1-D torch.int64 tensor: pass torch.tensor(ids, dtype=torch.int64)"
        )
    if block_ids.device != table.addrs.device:
        raise RuntimeUsageError(
            f"block_ids is on {block_ids.device} but the segment table is on "
            f"{table.addrs.device}; move the ids with .to({str(table.addrs.device)!r})"
        )
    n = block_ids.numel()
    if n == 0:
        return  # vLLM launches nothing for an empty list either
    block_size = min(triton.next_power_of_2(table.max_page), MAX_BLOCK_SIZE)
    max_chunks = triton.cdiv(table.max_page, block_size)
    if grid is None:
        grid = launch_grid(n, table.n_segs, max_chunks, block_ids.device.type)
    elif len(grid) != 3 or not all(isinstance(g, int) and g >= 1 for g in grid):
        raise RuntimeUsageError(f"grid={grid!r}: give three positive ints, e.g. (2, 2, 2)")
    kernel = _compiled if block_ids.is_cuda else _interpreted
    kernel[grid](table.addrs, table.block_strides, table.pages, block_ids, n, table.n_segs,
                 max_chunks, BLOCK_SIZE=block_size)


def zero_blocks_reference(cache: KVCache, block_ids: Sequence[int]) -> None:
    """Zero the pages of `block_ids` with plain torch indexing, without the segment table.

    For every distinct tensor and every part, logical block b is kernel-block rows
    b*ratio .. b*ratio + ratio - 1; the first `page_words` words of each row are its page.
    """
    ids = [int(b) for b in block_ids]
    for b in ids:
        if not 0 <= b < cache.spec.num_blocks:
            raise RuntimeUsageError(
                f"block id {b} is out of range for a cache of {cache.spec.num_blocks} blocks "
                f"(valid: 0..{cache.spec.num_blocks - 1})"
            )
    if not ids:
        return
    ratio = cache.spec.ratio
    rows = device_index(
        torch.tensor([b * ratio + j for b in ids for j in range(ratio)], dtype=torch.int64), cache.device
    )
    for t, tensor in enumerate(cache.spec.tensors):  # one raw buffer per tensor: shared once
        # index_fill_: an index_put_ (``[:, rows] = 0``) blocks the host on CUDA (seen on an H200)
        cache.word_rows(t)[:, :, : tensor.page_words].index_fill_(1, rows, 0)
