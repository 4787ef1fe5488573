"""A tensor written on the main stream and read on a side stream with no ordering. RACY.

Each step the main stream writes ``x`` (``x.copy_(...)``) and a kernel on ``side`` reads it
(``x * 2.0`` inside ``with torch.cuda.stream(side):``) with no event or ``wait_stream`` between
them, so the read may see the old or a half-written ``x``; the main stream then adds the side
stream's ``out`` into ``total``, again without waiting for ``side``.
"""

from __future__ import annotations

import argparse

import torch

N = 2048


def main(steps: int = 32) -> None:
    device = torch.device("cuda")
    side = torch.cuda.Stream()
    base = torch.arange(N, dtype=torch.float32, device=device)
    x = torch.zeros(N, dtype=torch.float32, device=device)
    total = torch.zeros(N, dtype=torch.float32, device=device)

    for step in range(steps):
        x.copy_(base + float(step))  # written on the main stream  # race: queued
        with torch.cuda.stream(side):
            out = x * 2.0  # RACE: the side stream reads x with no wait on the main stream  # race: later
        total += out  # RACE: the main stream reads out with no wait on the side stream

    torch.cuda.synchronize()
    base_host = torch.arange(N, dtype=torch.float32)
    want = 2.0 * (steps * base_host + steps * (steps - 1) / 2)
    got = total.cpu()
    if not torch.equal(got, want):
        bad = int((got != want).nonzero()[0])
        raise AssertionError(f"total[{bad}] = {got[bad].item()}, want {want[bad].item()} "
                             f"(sum over {steps} steps of 2 * x)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=32)
    main(parser.parse_args().steps)
