"""A main-stream tensor consumed on a side stream, then freed without ``record_stream``. RACY.

``hidden``, allocated on the main stream, is read by a kernel on ``side`` (which waits for main
first, correctly); then ``del hidden`` with no ``hidden.record_stream(side)``, so the caching
allocator may hand its memory to the next same-size ``scratch`` allocated on the main stream: the
main stream's ``scratch.fill_(-1.0)`` races with the side stream's pending read of ``hidden``.
"""

from __future__ import annotations

import argparse

import torch

N = 1024


def main(steps: int = 32) -> None:
    device = torch.device("cuda")
    main_stream = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    outs: list[torch.Tensor] = []  # produced on the side stream
    total = torch.zeros(N, dtype=torch.float32, device=device)

    for step in range(steps):
        hidden = torch.full((N,), float(step), dtype=torch.float32, device=device)  # on the main stream
        side.wait_stream(main_stream)  # the side stream sees hidden's values: correct
        with torch.cuda.stream(side):
            outs.append(hidden * 2.0 + 1.0)  # race: queued
        del hidden  # BUG: no hidden.record_stream(side): its block goes back to the main stream's pool
        scratch = torch.empty(N, dtype=torch.float32, device=device)  # may get hidden's memory
        scratch.fill_(-1.0)  # RACE with the side stream's queued read of hidden  # race: later
        total += scratch

    torch.cuda.synchronize()
    for step, out in enumerate(outs):
        got = out.cpu()
        if not torch.all(got == 2.0 * step + 1.0):
            raise AssertionError(f"step {step}: side-stream output holds {got.unique().tolist()}, "
                                 f"want {2.0 * step + 1.0}")
    if not torch.all(total.cpu() == -float(steps)):
        raise AssertionError(f"main-stream total holds {total.cpu().unique().tolist()}, want {-float(steps)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=32)
    main(parser.parse_args().steps)
