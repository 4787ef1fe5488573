"""The Triton zero kernel, its launcher, and a pure-torch reference to check it against.

The model. The kernel reads an address table of segments (see `zeroer.cache.layout`): for every
requested logical block `b` and every segment `s` it stores int32 zeros over
`[addr_s + b * block_stride_s * 4, + page_s * 4)` bytes, in chunks of BLOCK_SIZE words, with
masked stores so a chunk never runs past a page that is shorter than its stride (vLLM #50276).
All three grid axes are grid-stride loops, so any grid covers all the work and the launch stays
within CUDA's limits however many blocks, segments and chunks there are (vLLM #52058).

One Python function is used twice: compiled with `triton.jit` for CUDA tensors, and run by
Triton's interpreter for CPU tensors, in the same process (CI has no GPU; we do not rely on the
TRITON_INTERPRET environment variable). Under that interpreter Triton's @jit'd stdlib helpers
(`tl.zeros`...) fail, so the kernel uses builtins only.

The launcher is on every zeroer's hot path, so on CUDA it skips Triton's per-call dispatch
(binding, specialisation, cache key: tens of microseconds of host time) once a configuration has
been launched: :class:`CachedLauncher` keeps the compiled kernel and calls it directly. Nothing
is copied to the device per call; the table already lives there and the grid is three ints.

`zero_blocks_reference` zeroes the same words with plain torch indexing, from the spec's
geometry alone and never from the segment table, so comparing the two checks both the table and
the kernel.

Example:

    >>> import torch
    >>> from zeroer.cache.geometries import geometry
    >>> from zeroer.cache.layout import build_cache
    >>> kernel_cache, ref_cache = build_cache(geometry("tiny")), build_cache(geometry("tiny"))
    >>> zero_blocks(kernel_cache.table, torch.tensor([1, 5], dtype=torch.int64))
    >>> zero_blocks_reference(ref_cache, [1, 5])
    >>> all(torch.equal(a, b) for a, b in zip(kernel_cache.raws, ref_cache.raws))
    True
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from zeroer.errors import RuntimeUsageError
from zeroer.cache.layout import device_index

if TYPE_CHECKING:
    from zeroer.cache.layout import KVCache, SegmentTable

MAX_BLOCK_SIZE = 8192  # int32 words one program stores per chunk by default: 32 KiB
WORDS_PER_THREAD = 16  # default warps give each thread 64 bytes: four 16-byte stores
MAX_NUM_WARPS = 16
MIN_FILL = 0.8  # share of a page's chunks' stores that must land in the page (launch_config)
MIN_SPLIT_BLOCK_SIZE = 1024  # launch_config halves a chunk no further than this
CUDA_MAX_GRID_X = 2**31 - 1  # CUDA limit on gridDim.x
CUDA_MAX_GRID_YZ = 65535  # CUDA limit on gridDim.y and gridDim.z
INT32_MAX = 2**31 - 1  # Triton passes a larger int argument as i64: another compiled kernel


def _zero_kv_blocks(
    seg_addrs_ptr,  # int64[n_segs]: byte address of block 0's page in each segment
    seg_block_strides_ptr,  # int64[n_segs]: int32 words from one logical block to the next
    seg_pages_ptr,  # int64[n_segs]: int32 words to zero per logical block
    block_ids_ptr,  # int64[n_blocks]: logical block ids to zero
    n_blocks,  # number of ids
    n_segs,  # number of segments
    max_chunks,  # ceil(max page / BLOCK_SIZE)
    BLOCK_SIZE: tl.constexpr,  # int32 words per chunk, a power of two
    SKIP_NEGATIVE: tl.constexpr,  # an id < 0 zeroes nothing (padding; see zero_blocks)
):
    # Grid-stride loops on every axis: a grid clamped to CUDA's limits still covers all work
    # (vLLM #52058: 6,870 blocks x 181 segments x 2,336 chunks overflowed a flat grid).
    # `while`, not `range(tl.program_id(0), ...)`: Triton 3.6's interpreter cannot turn a
    # program id into a range() bound under NumPy 2.5 (its __index__ calls int() on a 1-D array).
    i = tl.program_id(0)
    while i < n_blocks:
        # Read when the kernel runs, not when it is enqueued: the value the #48085 race corrupts.
        block_id = tl.load(block_ids_ptr + i).to(tl.int64)
        seg_end = n_segs
        if SKIP_NEGATIVE:
            # A CUDA graph is captured for a fixed number of ids; the graph ring pads the rest
            # with -1 (zeroer.designs.graph_ring), which must zero nothing rather than a block.
            seg_end = tl.where(block_id < 0, 0, n_segs)
        s = tl.program_id(1)
        while s < seg_end:
            addr = tl.load(seg_addrs_ptr + s).to(tl.int64)
            stride = tl.load(seg_block_strides_ptr + s).to(tl.int64)
            page = tl.load(seg_pages_ptr + s).to(tl.int64)
            c = tl.program_id(2)
            # 64-bit byte offsets throughout: block_id * stride * 4 passes 2**31 on big caches.
            # Masked stores: never past a page shorter than its stride (packed views, vLLM #50276).
            if (addr % 16 == 0) & (stride % 4 == 0) & (page % 4 == 0):
                # Every realistic cache: pages 16-byte aligned, of whole 4-word groups. Telling the
                # compiler so turns 4-byte stores into 16-byte ones (st.global.v4.b32; seen in the
                # sm_90 PTX). Checked here per segment, so the launcher needs no host-side facts.
                # The pointer is built inside the branch because multiple_of() marks the op that
                # made its argument, and page // 4 * 4 (== page here) carries the hint for the mask.
                base4 = tl.multiple_of((addr + block_id * stride * 4).to(tl.pointer_type(tl.int32)), 16)
                page4 = page // 4 * 4
                while c < max_chunks:
                    cols = tl.arange(0, BLOCK_SIZE).to(tl.int64) + c.to(tl.int64) * BLOCK_SIZE
                    tl.store(base4 + cols, tl.full((BLOCK_SIZE,), 0, tl.int32), mask=cols < page4)
                    c += tl.num_programs(2)
            else:
                # The same loop without the hints (a helper would not run under the interpreter).
                base = (addr + block_id * stride * 4).to(tl.pointer_type(tl.int32))
                while c < max_chunks:
                    cols = tl.arange(0, BLOCK_SIZE).to(tl.int64) + c.to(tl.int64) * BLOCK_SIZE
                    tl.store(base + cols, tl.full((BLOCK_SIZE,), 0, tl.int32), mask=cols < page)
                    c += tl.num_programs(2)
            s += tl.num_programs(1)
        i += tl.num_programs(0)

_compiled = triton.jit(_zero_kv_blocks, do_not_specialize=["n_blocks", "n_segs", "max_chunks"])
_interpreted = InterpretedFunction(_zero_kv_blocks)


@dataclass(frozen=True)
class LaunchConfig:
    """The kernel's meta-parameters: words per chunk (a power of two) and warps per program."""

    block_size: int
    num_warps: int


def launch_config(max_page: int, block_size: int | None = None,
                  num_warps: int | None = None) -> LaunchConfig:
    """The default (or checked explicit) meta-parameters for pages of at most `max_page` words.

    A chunk covers the largest page up to MAX_BLOCK_SIZE words (32 KiB: one program per Llama
    page), and the warps give each thread WORDS_PER_THREAD words, i.e. four 16-byte stores.
    Measured on an H200 (docs/performance.md): whole 32 KiB pages with 16 warps beat 16 KiB
    chunks with 8 warps by 2-3% on scattered ids and by 8-10% on adjacent ones.
    `python -m fuzz.bench.kernel` measures the alternatives on the GPU.

    >>> launch_config(8192)
    LaunchConfig(block_size=8192, num_warps=16)
    >>> launch_config(10496)
    LaunchConfig(block_size=4096, num_warps=8)
    >>> launch_config(32)
    LaunchConfig(block_size=32, num_warps=1)
    >>> launch_config(8192, block_size=1024, num_warps=4)
    LaunchConfig(block_size=1024, num_warps=4)
    """
    if block_size is None:
        block_size = min(triton.next_power_of_2(max_page), MAX_BLOCK_SIZE)
        # A page longer than a chunk but not a whole number of chunks leaves the last chunk's
        # stores masked off: halve the chunk while more than a fifth would be (an MLA page of
        # 10,496 words fills two 8,192-word chunks to 64%, three 4,096-word ones to 85%).
        while block_size > MIN_SPLIT_BLOCK_SIZE and max_page > block_size and \
                max_page < MIN_FILL * triton.cdiv(max_page, block_size) * block_size:
            block_size //= 2
    elif not _power_of_two(block_size) or block_size > 2**16:
        raise RuntimeUsageError(
            f"block_size={block_size!r}: a chunk is a power of two of int32 words up to 65536, "
            f"e.g. 1024, or None for the default"
        )
    if num_warps is None:
        num_warps = max(1, min(MAX_NUM_WARPS, block_size // (32 * WORDS_PER_THREAD)))
    elif not _power_of_two(num_warps) or num_warps > 32:
        raise RuntimeUsageError(
            f"num_warps={num_warps!r}: give a power of two from 1 to 32, e.g. 4, or None for the default"
        )
    return LaunchConfig(block_size, num_warps)


def _power_of_two(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1 and x & (x - 1) == 0


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


class CachedLauncher:
    """Launch a `triton.jit` function's compiled kernel directly, skipping the JIT's dispatch.

    `fn[grid](*args)` binds the arguments, works out their specialisation (dtypes, 16-byte
    alignment, int widths), hashes a cache key and checks globals on every call. The first
    launch of each `key` goes through it and keeps the compiled kernel it returns; later launches
    with that key call the kernel's launcher with the very arguments `fn[grid]` would pass. So
    `key` must capture all Triton specialises on: device, constexprs and options, pointer dtypes
    and alignment, int widths (:func:`zero_blocks` builds it). `args` are every kernel parameter
    in order, constexprs included, as Triton 3.3 and later pass them (3.6 and 3.9 checked).
    Where the installed Triton lacks what this needs (`triton.knobs`, a compiled kernel with
    `run`, `function`, `packed_metadata`), every launch goes through the JIT.

    Triton settings changed after a first launch (debug, instrumentation) are not seen by
    later direct launches; :meth:`clear` forgets the kept kernels.

    Example (needs a GPU)::

        launcher = CachedLauncher(my_jit_fn)
        key = (torch.cuda.current_device(), 1024, 4)
        launcher.launch(key, (n, 1, 1), (x, n, 1024), num_warps=4)   # through the JIT, compiles
        launcher.launch(key, (n, 1, 1), (x, n, 1024), num_warps=4)   # direct
    """

    def __init__(self, fn: Any, *, current_stream: Callable[[int], int] | None = None,
                 knobs: Any = None) -> None:
        self.fn = fn
        self._kernels: dict[Hashable, Any] = {}  # key -> compiled kernel, or None: JIT only
        self._current_stream = current_stream  # tests inject these; default: Triton's own
        self._knobs = knobs if knobs is not None else getattr(triton, "knobs", None)
        self.jit_launches = 0
        self.direct_launches = 0

    def clear(self) -> None:
        self._kernels.clear()

    def launch(self, key: Hashable, grid: tuple[int, int, int], args: tuple, **options: Any) -> None:
        """Launch on the current device's current stream; `key[0]` must be the device index."""
        kernel = self._kernels.get(key, self)
        if kernel is not self and kernel is not None:
            if self._current_stream is None:
                self._current_stream = triton.runtime.driver.active.get_current_stream
            stream = self._current_stream(key[0])
            # Exactly the call JITFunction.run ends with (the hooks are HookChains, never None).
            runtime = self._knobs.runtime
            kernel.run(grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata,
                       kernel.launch_metadata(grid, stream, *args), runtime.launch_enter_hook,
                       runtime.launch_exit_hook, *args)
            self.direct_launches += 1
            return
        compiled = self.fn[grid](*args, **options)
        self.jit_launches += 1
        if kernel is self:  # first launch of this key: keep the kernel if it can be called directly
            self._kernels[key] = compiled if self._launchable(compiled, len(args)) else None

    def _launchable(self, kernel: Any, n_args: int) -> bool:
        if self._knobs is None or kernel is None:
            return False
        runtime = getattr(self._knobs, "runtime", None)
        signature = getattr(getattr(kernel, "src", None), "signature", None)
        return (
            hasattr(runtime, "launch_enter_hook") and hasattr(runtime, "launch_exit_hook")
            and all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata", "launch_metadata"))
            and getattr(kernel, "function", None) is not None
            # Launchers that take every parameter, constexprs included (Triton >= 3.3).
            and isinstance(signature, dict) and len(signature) == n_args
        )


_launcher = CachedLauncher(_compiled)


def _pointer_key(t: torch.Tensor) -> tuple:
    return (t.dtype, t.data_ptr() % 16 == 0)  # what Triton specialises a pointer argument on


def zero_blocks(table: SegmentTable, block_ids: torch.Tensor,
                grid: tuple[int, int, int] | None = None, *, block_size: int | None = None,
                num_warps: int | None = None, cached: bool = True,
                skip_negative: bool = False) -> None:
    """Zero the pages of `block_ids` in every segment of `table`, on `block_ids`' device.

    `block_ids` must be an int64 1-D tensor on the table's device. Its *values* are not checked
    here (that would cost a device sync per call, and the ids are read only when the kernel runs):
    the caller validates them, as vLLM's scheduler does. An explicit `grid` replaces the default
    (tests use small grids to exercise the grid-stride loops under the interpreter);
    `block_size` and `num_warps` replace :func:`launch_config`'s choice (the benchmark sweeps
    them). `cached=False` launches through Triton's JIT dispatch every time (the benchmark's
    comparison); the default keeps the compiled kernel (:class:`CachedLauncher`).
    `skip_negative=True` makes an id below 0 zero nothing: a CUDA graph captures a fixed id count
    and pads with -1 (:mod:`zeroer.designs.graph_ring`). It is a separate compiled kernel; the
    default keeps the plain one, in which a negative id is the caller's bug, as it is in vLLM.
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
    config = launch_config(table.max_page, block_size, num_warps)
    n = block_ids.numel()
    if n == 0:
        return  # vLLM launches nothing for an empty list either
    max_chunks = triton.cdiv(table.max_page, config.block_size)
    if grid is None:
        grid = launch_grid(n, table.n_segs, max_chunks, block_ids.device.type)
    elif len(grid) != 3 or not all(isinstance(g, int) and g >= 1 for g in grid):
        raise RuntimeUsageError(f"grid={grid!r}: give three positive ints, e.g. (2, 2, 2)")
    skip = bool(skip_negative)
    args = (table.addrs, table.block_strides, table.pages, block_ids, n, table.n_segs, max_chunks,
            config.block_size, skip)
    if not block_ids.is_cuda:
        _interpreted[grid](*args)
        return
    device = torch.cuda.current_device()
    if not cached or block_ids.device.index != device:
        # Another device than the current one: Triton's own dispatch, as before the cache.
        _compiled[grid](*args, num_warps=config.num_warps)
        return
    key = (device, config, skip, _pointer_key(table.addrs), _pointer_key(table.block_strides),
           _pointer_key(table.pages), block_ids.data_ptr() % 16 == 0,
           max(n, table.n_segs, max_chunks) <= INT32_MAX)
    _launcher.launch(key, grid, args, num_warps=config.num_warps)


def zero_blocks_reference(cache: KVCache, block_ids: Sequence[int]) -> None:
    """Zero the pages of `block_ids` with plain torch indexing, without the segment table.

    For every distinct tensor and every part, logical block b is kernel-block rows
    b*ratio .. b*ratio + ratio - 1; the first `page_words` words of each row are its page.
    """
    ids = cache.check_blocks(block_ids)
    if not ids.numel():
        return
    ratio = cache.spec.ratio
    rows = device_index((ids[:, None] * ratio + torch.arange(ratio)).reshape(-1), cache.device)
    for t, tensor in enumerate(cache.spec.tensors):  # one raw buffer per tensor: shared once
        # index_fill_: an index_put_ (``[:, rows] = 0``) blocks the host on CUDA (seen on an H200)
        cache.word_rows(t)[:, :, : tensor.page_words].index_fill_(1, rows, 0)
