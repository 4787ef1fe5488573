"""The zero kernel against the pure-torch reference, under Triton's CPU interpreter (and CUDA)."""

from __future__ import annotations

import gc
import mmap
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import zeroer.kernel as kernel
from zeroer.errors import RuntimeUsageError
from zeroer.cache.geometries import geometry, geometry_names
from zeroer.kernel import (CUDA_MAX_GRID_X, CUDA_MAX_GRID_YZ, CachedLauncher, LaunchConfig,
                           launch_config, launch_grid, zero_blocks, zero_blocks_reference)
from zeroer.cache.layout import GUARD_WORD, POISON_WORD, KVCache, SegmentTable, build_cache

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _id_lists(num_blocks: int) -> dict[str, list[int]]:
    last = num_blocks - 1
    return {
        "single": [1],
        "several": [1, 3, last - 1],
        "duplicates": [2, 2, 1, 2],
        "null_block": [0, 1],
        "last_block": [last],
    }


ID_KINDS = sorted(_id_lists(8))


def _zero_both(name: str, ids: list[int], device: str = "cpu",
               grid: tuple[int, int, int] | None = None) -> tuple[KVCache, KVCache]:
    """Zero `ids` with the kernel in one cache and the reference in another, both poisoned."""
    by_kernel = build_cache(geometry(name), device=device)
    by_reference = build_cache(geometry(name), device=device)
    zero_blocks(by_kernel.table, torch.tensor(ids, dtype=torch.int64, device=device), grid=grid)
    zero_blocks_reference(by_reference, ids)
    return by_kernel, by_reference


def _assert_same_bits_and_clean_guards(by_kernel: KVCache, by_reference: KVCache,
                                       ids: list[int]) -> None:
    for t, (a, b) in enumerate(zip(by_kernel.raws, by_reference.raws)):
        if not torch.equal(a, b):
            diff = (a != b).nonzero().flatten()[:5].tolist()
            raise AssertionError(f"tensor {t} differs from the reference at words {diff}")
    assert by_kernel.guard_violations() == []
    # An absolute oracle too, in case kernel and reference shared a mistake.
    for s in range(len(by_kernel.segments)):
        pages = by_kernel.pages(s)
        for b in range(by_kernel.spec.num_blocks):
            expected = 0 if b in ids else POISON_WORD
            assert (pages[b] == expected).all(), f"segment {s}, block {b}"


@pytest.mark.parametrize("kind", ID_KINDS)
@pytest.mark.parametrize("name", geometry_names())
def test_kernel_matches_reference_on_every_geometry(name, kind):
    ids = _id_lists(geometry(name).num_blocks)[kind]
    by_kernel, by_reference = _zero_both(name, ids)
    _assert_same_bits_and_clean_guards(by_kernel, by_reference, ids)


@pytest.mark.parametrize("grid", [(2, 2, 2), (3, 1, 2), (1, 3, 1), (4, 5, 16)])
@pytest.mark.parametrize("name", ["mla_indexer", "packed", "shared_layers", "tiny"])
def test_grid_stride_loops_cover_all_work_whatever_the_grid(name, grid):
    ids = [0, 2, 3, 3, geometry(name).num_blocks - 1]
    by_kernel, by_reference = _zero_both(name, ids, grid=grid)
    _assert_same_bits_and_clean_guards(by_kernel, by_reference, ids)


@st.composite
def geometry_and_ids(draw: st.DrawFn) -> tuple[str, list[int]]:
    name = draw(st.sampled_from(geometry_names()))
    ids = draw(st.lists(st.integers(0, geometry(name).num_blocks - 1), min_size=1, max_size=6))
    return name, ids


@settings(max_examples=25, deadline=None)
@given(case=geometry_and_ids(), grid=st.tuples(*[st.integers(1, 3)] * 3))
def test_kernel_matches_reference_for_any_ids_and_grid(case, grid):
    name, ids = case
    by_kernel, by_reference = _zero_both(name, ids, grid=grid)
    _assert_same_bits_and_clean_guards(by_kernel, by_reference, ids)


def test_launch_grid_keeps_the_52058_shape_within_cuda_limits():
    # vLLM #52058: a flat grid of blocks x segments x chunks passed 2**31 programs.
    assert 6870 * 181 * 2336 > CUDA_MAX_GRID_X
    x, y, z = launch_grid(6870, 181, 2336, "cuda")
    assert (x, y, z) == (6870, 181, 2336)
    assert x <= CUDA_MAX_GRID_X and y <= CUDA_MAX_GRID_YZ and z <= CUDA_MAX_GRID_YZ
    assert launch_grid(2**40, 70_000, 100_000, "cuda") == (2**31 - 1, 65535, 65535)
    assert launch_grid(6870, 181, 2336, "cpu") == (1, 1, 1)


def test_empty_block_ids_launch_nothing(monkeypatch):
    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError(f"launched with grid {grid}")

    monkeypatch.setattr(kernel, "_interpreted", NoLaunch())
    cache = build_cache(geometry("tiny"))
    before = [r.clone() for r in cache.raws]
    zero_blocks(cache.table, torch.tensor([], dtype=torch.int64))
    assert all(torch.equal(a, b) for a, b in zip(before, cache.raws))


# Block BIG_ID sits BIG_ID * STRIDE = 2**32 + 2**10 words = 2**34 + 2**12 bytes past its
# segment's base: past 32 bits whether a kernel counts in words or in bytes, signed or not.
BIG_ID, STRIDE, PAGE = 2**22 + 1, 2**10, 16
OFFSET = BIG_ID * STRIDE * 4
WRAPPED = 2**12  # where the page would land if either offset wrapped at 32 bits
SPAN = OFFSET + PAGE * 4 + 4096


@contextmanager
def _sparse_span(device: str) -> Iterator[tuple[int, Callable[[int, int], torch.Tensor]]]:
    """A SPAN-byte buffer of which only the pages we touch cost memory: (base, window)."""
    if device == "cuda":
        try:
            buf = torch.empty(SPAN // 4, dtype=torch.int32, device=device)
        except torch.cuda.OutOfMemoryError:
            pytest.skip(f"needs {SPAN / 2**30:.0f} GiB of free GPU memory")
        yield buf.data_ptr(), lambda at, n: buf[at // 4: at // 4 + n]
        return
    if sys.platform != "linux":
        pytest.skip("needs Linux's MAP_NORESERVE to map a sparse 16 GiB buffer")
    noreserve = getattr(mmap, "MAP_NORESERVE", 0x4000)  # not exposed before Python 3.13
    try:
        mm = mmap.mmap(-1, SPAN, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | noreserve)
    except OSError as e:
        pytest.skip(f"cannot map a sparse {SPAN / 2**30:.0f} GiB buffer: {e}")
    try:
        base = torch.frombuffer(mm, dtype=torch.uint8, count=1).data_ptr()
        yield base, lambda at, n: torch.frombuffer(mm, dtype=torch.int32, offset=at, count=n)
    finally:
        gc.collect()  # drop the windows' exports so the map can close
        mm.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_block_offsets_are_computed_in_64_bits(device):
    """Zero block 2**22 + 1 of a segment whose page lies 16 GiB past its base.

    Memory-safe even for a broken kernel: the buffer spans both the right address and the one
    a 32-bit wrap would give, so a wrap shows as a wrong word, not a fault.
    """
    assert OFFSET > 2**34 and (BIG_ID * STRIDE) % 2**32 * 4 == OFFSET % 2**32 == WRAPPED
    with _sparse_span(device) as (base, window):
        target, wrapped = window(OFFSET - 32, PAGE + 16), window(WRAPPED - 32, PAGE + 16)
        target.fill_(GUARD_WORD)
        wrapped.fill_(GUARD_WORD)
        table = SegmentTable.from_rows([base], [STRIDE], [PAGE], device)
        zero_blocks(table, torch.tensor([BIG_ID], dtype=torch.int64, device=device))
        expected = torch.full_like(target, GUARD_WORD)
        expected[8: 8 + PAGE] = 0
        assert torch.equal(wrapped, torch.full_like(wrapped, GUARD_WORD)), "offset wrapped"
        assert torch.equal(target, expected)
        del target, wrapped


def test_launcher_refuses_ids_of_the_wrong_dtype_and_bad_grids():
    cache = build_cache(geometry("tiny"))
    with pytest.raises(RuntimeUsageError, match=r"^block_ids has dtype torch\.int32 and 1 dims; "
                       r"the kernel reads a 1-D torch\.int64 tensor: pass "
                       r"torch\.tensor\(ids, dtype=torch\.int64\)$"):
        zero_blocks(cache.table, torch.tensor([1], dtype=torch.int32))
    with pytest.raises(RuntimeUsageError,
                       match=rf"^{re.escape('grid=(0, 1, 1): give three positive ints, e.g. (2, 2, 2)')}$"):
        zero_blocks(cache.table, torch.tensor([1]), grid=(0, 1, 1))


def test_reference_refuses_block_ids_outside_the_cache():
    cache = build_cache(geometry("tiny"))
    with pytest.raises(RuntimeUsageError, match=r"^block id -1 is out of range for a cache of 8 "
                                                r"blocks \(valid: 0\.\.7\)$"):
        zero_blocks_reference(cache, [-1])


@needs_cuda
@pytest.mark.parametrize("name", geometry_names())
def test_compiled_kernel_matches_reference_on_cuda(name):
    for kind, ids in sorted(_id_lists(geometry(name).num_blocks).items()):
        by_kernel, by_reference = _zero_both(name, ids, device="cuda")
        torch.cuda.synchronize()
        _assert_same_bits_and_clean_guards(by_kernel, by_reference, ids)
    # Grid-stride loops compiled, not only interpreted.
    ids = [0, 3, geometry(name).num_blocks - 1]
    by_kernel, by_reference = _zero_both(name, ids, device="cuda", grid=(2, 1, 3))
    torch.cuda.synchronize()
    _assert_same_bits_and_clean_guards(by_kernel, by_reference, ids)


# -- launch configurations, aligned and unaligned pages, the cached launcher ---------------------

# (offset in words, block stride, page) per segment of one hand-made buffer, 6 blocks each:
# aligned pages (16-byte address, stride and page in whole 4-word groups) take the kernel's
# 16-byte-store branch, the others its 4-byte one, in the same launch.
MIXED_ROWS = [
    (16, 64, 64),  # aligned
    (401, 37, 35),  # address 4 bytes past 16, odd stride and page
    (640, 40, 40),  # aligned
    (900, 36, 33),  # aligned address and stride, page not whole 4-word groups
    (1202, 44, 44),  # address 8 bytes past 16
]
MIXED_WORDS, MIXED_IDS = 1500, [0, 2, 5]


@pytest.mark.parametrize("block_size", [None, 8])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_aligned_and_unaligned_segments_zero_exactly_their_pages(device, block_size):
    buf = torch.full((MIXED_WORDS,), GUARD_WORD, dtype=torch.int32, device=device)
    assert buf.data_ptr() % 16 == 0
    table = SegmentTable.from_rows([buf.data_ptr() + 4 * off for off, _, _ in MIXED_ROWS],
                                   [stride for _, stride, _ in MIXED_ROWS],
                                   [page for _, _, page in MIXED_ROWS], device)
    zero_blocks(table, torch.tensor(MIXED_IDS, dtype=torch.int64, device=device), block_size=block_size)
    expected = torch.full_like(buf, GUARD_WORD)
    for off, stride, page in MIXED_ROWS:
        for b in MIXED_IDS:
            expected[off + b * stride: off + b * stride + page] = 0
    assert torch.equal(buf.cpu(), expected.cpu())


@pytest.mark.parametrize("cached", [True, False])
@pytest.mark.parametrize("config", [(4, 1), (64, 2), (4096, 8)])
@pytest.mark.parametrize("name", ["mla_indexer", "packed", "tiny"])
def test_every_launch_config_zeroes_the_same_words_as_the_reference(name, config, cached):
    block_size, num_warps = config
    ids = [0, 2, geometry(name).num_blocks - 1]
    by_kernel = build_cache(geometry(name))
    by_reference = build_cache(geometry(name))
    zero_blocks(by_kernel.table, torch.tensor(ids), block_size=block_size, num_warps=num_warps,
                cached=cached)
    zero_blocks_reference(by_reference, ids)
    _assert_same_bits_and_clean_guards(by_kernel, by_reference, ids)


def test_launch_config_gives_each_thread_sixteen_words_and_names_bad_values():
    assert launch_config(8192) == LaunchConfig(block_size=8192, num_warps=16)  # Llama-3-8B pages
    assert launch_config(10496) == LaunchConfig(block_size=4096, num_warps=8)  # MLA: chunks 85% full
    assert launch_config(65536) == LaunchConfig(block_size=8192, num_warps=16)  # 256 KiB pages
    assert launch_config(2048) == LaunchConfig(block_size=2048, num_warps=4)
    assert launch_config(33) == LaunchConfig(block_size=64, num_warps=1)
    assert launch_config(8192, block_size=1024) == LaunchConfig(block_size=1024, num_warps=2)
    with pytest.raises(RuntimeUsageError, match=r"^block_size=3: a chunk is a power of two of int32 "
                       r"words up to 65536, e\.g\. 1024, or None for the default$"):
        launch_config(64, block_size=3)
    with pytest.raises(RuntimeUsageError, match=r"^num_warps=3: give a power of two from 1 to 32, "
                       r"e\.g\. 4, or None for the default$"):
        zero_blocks(build_cache(geometry("tiny")).table, torch.tensor([1]), num_warps=3)


class _FakeCompiled:
    """What Triton's JIT returns, reduced to what CachedLauncher uses; records its launches."""

    def __init__(self, n_params: int) -> None:
        self.src = SimpleNamespace(signature={f"p{i}": "i32" for i in range(n_params)})
        self.function, self.packed_metadata = "function-handle", "packed-metadata"
        self.launches: list[tuple] = []

    def run(self, *launch_args: object) -> None:
        self.launches.append(launch_args)

    def launch_metadata(self, grid: tuple, stream: int, *args: object) -> tuple:
        return ("launch-metadata", grid, stream)


class _FakeJit:
    """A JIT function: fn[grid](*args, **options) launches and returns the compiled kernel."""

    def __init__(self, compiled: object) -> None:
        self.compiled, self.launches = compiled, []

    def __getitem__(self, grid: tuple) -> Callable[..., object]:
        def launch(*args: object, **options: object) -> object:
            self.launches.append((grid, args, options))
            return self.compiled

        return launch


HOOKS = SimpleNamespace(runtime=SimpleNamespace(launch_enter_hook="enter", launch_exit_hook="exit"))


def test_the_cached_launcher_calls_the_compiled_kernel_as_the_jit_would_after_its_first_launch():
    compiled = _FakeCompiled(3)
    jit = _FakeJit(compiled)
    launcher = CachedLauncher(jit, current_stream=lambda device: 7000 + device, knobs=HOOKS)
    launcher.launch((1, "config"), (3, 2, 1), ("ptr", 5, 64), num_warps=4)  # compiles: the JIT
    launcher.launch((1, "config"), (4, 2, 1), ("ptr", 6, 64), num_warps=4)  # direct
    assert jit.launches == [((3, 2, 1), ("ptr", 5, 64), {"num_warps": 4})]
    # JITFunction.run's own last call: grid, stream, function, metadata, hooks, every argument.
    assert compiled.launches == [(4, 2, 1, 7001, "function-handle", "packed-metadata",
                                  ("launch-metadata", (4, 2, 1), 7001), "enter", "exit", "ptr", 6, 64)]
    launcher.launch((0, "config"), (1, 1, 1), ("ptr", 1, 64), num_warps=4)  # a new key: the JIT
    assert len(jit.launches) == 2 and (launcher.jit_launches, launcher.direct_launches) == (2, 1)


@pytest.mark.parametrize("why", ["no launch hooks in this triton", "launcher without constexprs",
                                 "kernel not loaded"])
def test_the_cached_launcher_keeps_using_the_jit_where_triton_lacks_what_it_needs(why):
    compiled = _FakeCompiled(2 if why == "launcher without constexprs" else 3)
    if why == "kernel not loaded":
        compiled.function = None
    knobs = SimpleNamespace() if why == "no launch hooks in this triton" else HOOKS
    jit = _FakeJit(compiled)
    launcher = CachedLauncher(jit, current_stream=lambda device: 0, knobs=knobs)
    for _ in range(3):
        launcher.launch((0,), (1, 1, 1), ("ptr", 5, 64))
    assert len(jit.launches) == 3 and compiled.launches == []


def test_the_cached_launcher_runs_the_interpreter_through_its_fallback():
    ids = [1, 3]
    by_kernel, by_reference = build_cache(geometry("tiny")), build_cache(geometry("tiny"))
    launcher = CachedLauncher(kernel._interpreted)
    t = by_kernel.table
    for _ in range(2):
        launcher.launch((0,), (1, 1, 1), (t.addrs, t.block_strides, t.pages, torch.tensor(ids), 2,
                                          t.n_segs, 1, 32, False))
    zero_blocks_reference(by_reference, ids)
    _assert_same_bits_and_clean_guards(by_kernel, by_reference, ids)
    assert (launcher.jit_launches, launcher.direct_launches) == (2, 0)


@needs_cuda
def test_zero_blocks_launches_directly_from_the_second_call_on_cuda():
    ids = [1, 3, 5]
    by_kernel, by_reference = build_cache(geometry("kv_outer_bf16"), device="cuda"), \
        build_cache(geometry("kv_outer_bf16"), device="cuda")
    before = kernel._launcher.direct_launches
    for b in ids:  # the first call may compile; the others must not go through the JIT
        zero_blocks(by_kernel.table, torch.tensor([b], dtype=torch.int64, device="cuda"))
    assert kernel._launcher.direct_launches >= before + len(ids) - 1
    zero_blocks(by_kernel.table, torch.tensor(ids, dtype=torch.int64, device="cuda"), cached=False)
    zero_blocks_reference(by_reference, ids)
    torch.cuda.synchronize()
    _assert_same_bits_and_clean_guards(by_kernel, by_reference, ids)
