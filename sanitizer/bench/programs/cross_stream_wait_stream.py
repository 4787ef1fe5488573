"""A tensor written on the main stream and read on a side stream, ordered both ways. Race-free.

Twin of ``cross_stream_no_wait``: ``side.wait_stream(main)`` before the side stream reads ``x``,
and ``main.wait_stream(side)`` before the main stream uses ``out`` (and rewrites ``x``).
"""

from __future__ import annotations

import argparse

import torch

N = 2048


def main(steps: int = 32) -> None:
    device = torch.device("cuda")
    main_stream = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    base = torch.arange(N, dtype=torch.float32, device=device)
    x = torch.zeros(N, dtype=torch.float32, device=device)
    total = torch.zeros(N, dtype=torch.float32, device=device)

    for step in range(steps):
        x.copy_(base + float(step))  # written on the main stream
        side.wait_stream(main_stream)  # x is written before the side stream reads it
        with torch.cuda.stream(side):
            out = x * 2.0
        main_stream.wait_stream(side)  # out is written (and x read) before the main stream goes on
        total += out

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
