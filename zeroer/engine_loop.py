"""A user's zeroer driven by a plain engine loop, outside kvzero's harness: what the sanitizer sees.

The fuzz campaigns run a zeroer inside kvzero's harness, whose CUDA runtime orders streams with
gate kernels the sanitizer steps aside for. This loop runs the same zeroer (a ``file.py:factory``
spec written the way vLLM writes it, built with ``runtime=None``) the way an engine does, on real
streams with nothing of ours in between, so ``python -m sanitizer`` can check it: each step
allocates a few free blocks, zeroes them on the current stream, checks on the device that they
read zero, writes their KV, and frees some live blocks (their pages poisoned, as a recycled Mamba
page holds NaN bytes). Now and then the engine hands over to its other stream, ordered after the
first with ``wait_stream``, as a scheduler moving work to a side stream does. The loop itself is
race-free; a race the sanitizer reports is the zeroer's. At the end it checks its device counters
and raises ``AssertionError`` when a block read non-zero after zeroing.

Example::

    python -m sanitizer -- python -m zeroer.engine_loop \\
        --zeroer examples/engine_zeroers.py:fresh_pinned_per_call --steps 64
"""

from __future__ import annotations

import random

import torch

from racecheck.cli import ArgumentParser
from zeroer.cache.geometries import geometry, geometry_names
from zeroer.cache.layout import build_cache
from zeroer.protocol import ZeroerSpecError
from zeroer.registry import load_zeroer

WRITTEN_WORD = 0x5EED  # what the engine writes into a block it owns


def main(zeroer: str, steps: int = 48, seed: int = 0, geometry_name: str = "tiny") -> None:
    device = torch.device("cuda")
    cache = build_cache(geometry(geometry_name), device=device)
    built = load_zeroer(zeroer).factory(cache, None)
    warmup = getattr(built, "warmup", None)
    if callable(warmup):
        warmup()
    streams = [torch.cuda.current_stream(), torch.cuda.Stream()]
    rng = random.Random(seed)
    free = list(range(cache.spec.num_blocks))
    live: list[int] = []
    nonzero = torch.zeros((), dtype=torch.int64, device=device)  # words read non-zero after zeroing
    on = 0
    for _ in range(steps):
        if rng.random() < 0.3:  # hand over to the other stream, after everything issued so far
            streams[1 - on].wait_stream(streams[on])
            on = 1 - on
        with torch.cuda.stream(streams[on]):
            take = rng.sample(free, min(len(free), rng.randint(1, 3)))
            for block in take:
                free.remove(block)
            built.zero_block_ids(take)
            if take:
                ids = torch.tensor(take, dtype=torch.int64).pin_memory().to(device, non_blocking=True)
                for seg in range(len(cache.segments)):
                    nonzero += (cache.pages(seg).index_select(0, ids) != 0).sum()
                cache.fill_pages(take, WRITTEN_WORD)
            live.extend(take)
            if live and (not free or rng.random() < 0.5):
                drop = rng.sample(live, min(len(live), rng.randint(1, 2)))
                cache.poison(drop)
                for block in drop:
                    live.remove(block)
                free.extend(drop)
    torch.cuda.synchronize()
    if int(nonzero.item()) != 0:
        raise AssertionError(f"{int(nonzero.item())} words of blocks read non-zero right after "
                             f"{zeroer} zeroed them")


if __name__ == "__main__":
    parser = ArgumentParser(prog="python -m zeroer.engine_loop", description=__doc__.splitlines()[0])
    parser.add_argument("--zeroer", required=True, help="the zeroer: file.py:factory or module:factory")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--geometry", default="tiny")
    options = parser.parse_args()
    if options.geometry not in geometry_names():
        parser.error(f"--geometry {options.geometry!r} is not one of {', '.join(geometry_names())}")
    try:
        load_zeroer(options.zeroer)
    except ZeroerSpecError as error:
        parser.error(f"--zeroer: {error}")
    main(options.zeroer, options.steps, options.seed, options.geometry)
