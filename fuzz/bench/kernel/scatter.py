"""``python -m fuzz.bench.kernel.scatter``: what limits the zero kernel on scattered pages.

On the benchmark's ``llama`` cache (64 segments of 32 KiB pages, 2 MiB a block, 8 GiB in all)
the kernel writes adjacent blocks at 95-98% of a contiguous ``zero_()`` of the same bytes, and
scattered ones at 84-87% (docs/performance.md). This run separates the candidate causes. Every
figure is ``zero_()``'s GPU time over the writer's, both for the same byte count and timed one
after the other (1.0: as fast as one contiguous zero):

* **order against address set**: adjacent ids 1..n, the same ids shuffled, the benchmark's
  scattered ids and the same ids sorted into address order, and every k-th block (k = 2, 4, 8,
  16: 32 KiB runs with gaps of k - 1 pages);
* **launch order**: a grid with the segment fastest, so the 64 pages of one block are launched
  side by side (the pages are checked for zeros afterwards);
* **another writer**: PyTorch's own ``index_fill_`` on the same scattered pages, one kernel per
  layer (what ``zero_blocks_reference`` does);
* **footprint**: the same count of scattered ids in caches of other sizes (1, 32 and 64 GiB by
  default), for the address-translation reach.

Run it on the GPU (about 10 s on an H200; the largest cache needs that much free memory)::

    python -m fuzz.bench.kernel.scatter --json scatter.json

and without one, to check that it still runs (CPU tensors, Triton's interpreter, caches of a
few blocks; its ratios are not figures)::

    python -m fuzz.bench.kernel.scatter --quick

The exit status (:mod:`racecheck.cli`) is 1 when the segment-fastest grid left a page unzeroed, 2 for
bad arguments (one line naming the value), 3 for a bug in this tool.
The H200 figures and what they mean: docs/performance.md, "What limits it".
"""

from __future__ import annotations

import argparse
import datetime
import random
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from racecheck.atomic_file import write_json_atomically
from fuzz.bench import command
from racecheck.cli import CLEAN, FINDING, ArgumentParser, check_output
from fuzz.bench.kernel.caches import BENCH_BLOCKS, QUICK_BLOCKS, _llama, bytes_per_block
from fuzz.bench.kernel.cli import _int_list
from fuzz.bench.kernel.measure import pages_zeroed, pick_ids
from fuzz.bench.kernel.report import versions
from fuzz.bench.kernel.timing import Timer
from zeroer.cache.layout import CacheSpec, KVCache, build_cache
from zeroer.kernel import zero_blocks

DEFAULT_BLOCKS = (256, 1024)
DEFAULT_CACHE_GIB = (1, 32, 64)  # beside the benchmark cache's 8 GiB
QUICK_IDS = (4,)
QUICK_FOOTPRINTS = (9, 33)  # --quick: cache sizes in blocks
PROG = "python -m fuzz.bench.kernel.scatter"
STRIDES = (2, 4, 8, 16)  # every k-th block
SHUFFLE_SEED = 7
SCHEMA = "zeroer-scatter/1"


def _seg_fastest(
    seg_addrs_ptr,  # int64[n_segs]: byte address of block 0's page in each segment
    seg_block_strides_ptr,  # int64[n_segs]: int32 words from one block to the next
    seg_pages_ptr,  # int64[n_segs]: int32 words to zero per block
    block_ids_ptr,  # int64[n_blocks]: block ids to zero
    BLOCK_SIZE: tl.constexpr,  # int32 words per program: at least the largest page
):
    # Grid (n_segs, n_blocks), x = segment: the pages of one block are launched next to each
    # other, where zero_blocks' grid puts the blocks fastest. Aligned pages only (the bench caches).
    s = tl.program_id(0)
    block_id = tl.load(block_ids_ptr + tl.program_id(1)).to(tl.int64)
    addr = tl.load(seg_addrs_ptr + s).to(tl.int64)
    stride = tl.load(seg_block_strides_ptr + s).to(tl.int64)
    page = tl.load(seg_pages_ptr + s).to(tl.int64)
    base4 = tl.multiple_of((addr + block_id * stride * 4).to(tl.pointer_type(tl.int32)), 16)
    cols = tl.arange(0, BLOCK_SIZE).to(tl.int64)
    tl.store(base4 + cols, tl.full((BLOCK_SIZE,), 0, tl.int32), mask=cols < page // 4 * 4)


_seg_fastest_compiled = triton.jit(_seg_fastest)
_seg_fastest_interpreted = InterpretedFunction(_seg_fastest)


def cache_spec(blocks: int, quick: bool) -> CacheSpec:
    """The benchmark's Llama-like cache with ``blocks`` blocks (scaled down with ``quick``)."""
    return _llama(2, 2, blocks) if quick else _llama(32, 8, blocks)


def blocks_for_gib(gib: int) -> int:
    """Blocks of a full-size cache that fill ``gib`` GiB, plus the null block 0."""
    return gib * 2**30 // bytes_per_block(cache_spec(2, quick=False)) + 1


class Scatter:
    """One run: the device, its timer, and the rows measured so far."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.timer = Timer(device)
        self.rows: list[dict[str, Any]] = []

    def emit(self, cache: KVCache, n: int, variant: str, writer_us: float | None, zero_us: float,
             **extra: Any) -> None:
        blocks = cache.spec.num_blocks
        row: dict[str, Any] = {
            "variant": variant, "blocks": n, "cache_blocks": blocks,
            "cache_gib": round((blocks - 1) * bytes_per_block(cache.spec) / 2**30, 3),
            "zero_us": round(zero_us, 2),
        }
        if writer_us is not None:
            row["writer_us"] = round(writer_us, 2)
            row["ratio"] = round(zero_us / writer_us, 3)
        row.update(extra)
        self.rows.append(row)
        shown = f"{row['ratio']:.3f} of zero_()" if "ratio" in row else f"{row['zero_us']} us"
        print(f"{variant:34s} {n:5d} of {blocks:,} blocks: {shown}", flush=True)

    def zero_us(self, n: int, spec: CacheSpec) -> float:
        """GPU time of ``zero_()`` on a contiguous buffer of ``n`` blocks' bytes."""
        buf = torch.empty(n * bytes_per_block(spec) // 4, dtype=torch.int32, device=self.device)
        us, _ = self.timer.gpu_us(buf.zero_)
        del buf
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return us

    def time(self, fn: Callable[[], object]) -> float:
        return self.timer.gpu_us(fn)[0]

    def kernel(self, cache: KVCache, ids: list[int], n: int, variant: str, z: float) -> None:
        t = torch.tensor(ids, dtype=torch.int64, device=self.device)
        self.emit(cache, n, variant, self.time(lambda: zero_blocks(cache.table, t)), z)

    def on_one_cache(self, cache: KVCache, n: int) -> None:
        """Every id set and writer on ``cache`` (the benchmark's), ``n`` blocks each."""
        blocks = cache.spec.num_blocks
        z = self.zero_us(n, cache.spec)
        self.emit(cache, n, "zero_() (contiguous)", None, z)
        scattered = pick_ids(n, blocks)
        adjacent = list(range(1, n + 1))
        shuffled = adjacent[:]
        random.Random(SHUFFLE_SEED).shuffle(shuffled)
        self.kernel(cache, adjacent, n, "adjacent 1..n", z)
        self.kernel(cache, shuffled, n, "adjacent 1..n, random order", z)
        for k in STRIDES:
            if 1 + k * (n - 1) < blocks:
                ordinal = f"{k}nd" if k == 2 else f"{k}th"
                self.kernel(cache, [1 + k * i for i in range(n)], n, f"every {ordinal} block", z)
        self.kernel(cache, scattered, n, "scattered", z)
        self.kernel(cache, sorted(scattered), n, "scattered, sorted", z)

        rows = torch.tensor(scattered, dtype=torch.int64, device=self.device)

        def torch_fill() -> None:
            for t, tensor in enumerate(cache.spec.tensors):
                cache.word_rows(t)[:, :, : tensor.page_words].index_fill_(1, rows, 0)

        self.emit(cache, n, "scattered, torch index_fill_", self.time(torch_fill), z)

        table = cache.table
        size = triton.next_power_of_2(table.max_page)
        launch = _seg_fastest_compiled if self.device.type == "cuda" else _seg_fastest_interpreted

        def seg_fastest() -> None:
            launch[(table.n_segs, n)](table.addrs, table.block_strides, table.pages, rows, BLOCK_SIZE=size)

        us = self.time(seg_fastest)
        cache.poison(scattered)
        self.timer.sync()
        seg_fastest()
        self.timer.sync()
        self.emit(cache, n, "scattered, segment-fastest grid", us, z, pages_zeroed=pages_zeroed(cache, rows))

    def footprint(self, cache: KVCache, counts: Sequence[int]) -> None:
        """The same counts of scattered ids in ``cache``, a cache of another size."""
        for n in counts:
            if n < cache.spec.num_blocks:
                self.kernel(cache, pick_ids(n, cache.spec.num_blocks), n, "scattered", self.zero_us(n, cache.spec))


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    device = torch.device("cpu") if args.quick else torch.device("cuda", torch.cuda.current_device())
    bench = Scatter(device)
    result: dict[str, Any] = {
        "schema": SCHEMA, "command": shlex.join(["python", "-m", "fuzz.bench.kernel.scatter", *argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device), "quick": args.quick, "versions": versions(device), "rows": bench.rows,
    }
    footprints = QUICK_FOOTPRINTS if args.quick else [blocks_for_gib(g) for g in args.cache_gib]
    # The benchmark's cache first (every id set and writer), then caches of other sizes, one at a time.
    for index, blocks in enumerate([QUICK_BLOCKS if args.quick else BENCH_BLOCKS, *footprints]):
        cache = build_cache(cache_spec(blocks, args.quick), device=device, fill="zero")
        bench.timer.sync()
        if index == 0:
            for n in args.blocks:
                bench.on_one_cache(cache, n)
        else:
            bench.footprint(cache, args.blocks)
        del cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


def render(rows: list[dict[str, Any]]) -> str:
    """The ratios as a markdown table, one row per writer and cache, one column per block count."""
    counts = sorted({r["blocks"] for r in rows})
    cells: dict[tuple[str, int, float], dict[int, str]] = {}
    for r in rows:
        if "ratio" in r:
            mark = "" if r.get("pages_zeroed", True) else " (pages NOT zeroed)"
            key = (r["variant"], r["cache_blocks"], r["cache_gib"])
            cells.setdefault(key, {})[r["blocks"]] = f"{r['ratio']:.3f}{mark}"
    lines = ["| ids and writer | cache | " + " | ".join(f"{n} blocks" for n in counts) + " |",
             "| --- | ---: | " + " | ".join("---:" for _ in counts) + " |"]
    for (variant, blocks, gib), by_count in cells.items():
        lines.append(f"| {variant} | {gib:g} GiB ({blocks:,} blocks) | "
                     + " | ".join(by_count.get(n, "-") for n in counts) + " |")
    return "\n".join(lines)


@command(PROG)
def main(argv: list[str]) -> int:
    """Entry point; returns the exit status (see the module docstring)."""
    p = ArgumentParser(
        prog=PROG,
        description="What limits the zero kernel on scattered pages: the kernel against zero_() of the same "
                    "bytes for adjacent, shuffled, strided and scattered ids, another launch order, "
                    "PyTorch's index_fill_, and caches of other sizes. Figures come only from a GPU; "
                    "--quick is a CPU smoke test.")
    p.add_argument("--quick", action="store_true",
                   help="CPU smoke test: Triton's interpreter, caches of a few blocks (ratios are not figures)")
    p.add_argument("--blocks", type=_int_list("--blocks"), default=None,
                   help=f"blocks zeroed per call (default {','.join(map(str, DEFAULT_BLOCKS))}; "
                        f"--quick {','.join(map(str, QUICK_IDS))})")
    p.add_argument("--cache-gib", type=_int_list("--cache-gib"), default=list(DEFAULT_CACHE_GIB),
                   help=f"other cache sizes for the footprint rows, in GiB (default "
                        f"{','.join(map(str, DEFAULT_CACHE_GIB))}; --quick: caches of "
                        f"{' and '.join(map(str, QUICK_FOOTPRINTS))} blocks instead)")
    p.add_argument("--json", type=Path, help="write the rows, versions and command here")
    args = p.parse_args(argv)
    if not args.quick and not torch.cuda.is_available():
        p.error("no CUDA GPU here (torch.cuda.is_available() is False) and this measures a GPU; "
                "run python -m fuzz.bench.kernel.scatter --quick for the CPU smoke test")
    args.blocks = args.blocks or list(QUICK_IDS if args.quick else DEFAULT_BLOCKS)
    limit = (QUICK_BLOCKS if args.quick else BENCH_BLOCKS) - 1
    if max(args.blocks) > limit:
        p.error(f"argument --blocks: {max(args.blocks)} is more than the {limit} blocks the benchmark "
                f"cache{' (--quick)' if args.quick else ''} can zero (block 0 is the null block); use at most {limit}")
    check_output("--json", args.json)
    result = run(args, argv)
    print("\n" + render(result["rows"]))
    if args.json:
        write_json_atomically(args.json, result)
        print(f"\nJSON written to {args.json}")
    return CLEAN if all(r.get("pages_zeroed", True) for r in result["rows"]) else FINDING


if __name__ == "__main__":
    sys.exit(main())
