"""Async scheduling with TWO pinned input buffers, alternating. Race-free.

Twin of ``async_sched_shared_input``: step N stages into ``inputs[N % 2]``. Before the scheduler
writes step N+1's tokens into a buffer it synchronises ``copied[b]``, the event recorded on the
copying stream right after the H2D copy that last read that buffer (step N-1's).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

VOCAB = 128
HIDDEN = 32
MAX_TOKENS = 16


def step_tokens(step: int) -> np.ndarray:
    """The token ids scheduled at ``step``: 4..16 of them, different every step."""
    n = 4 + (step * 5) % (MAX_TOKENS - 3)
    return ((step * 13 + np.arange(n) * 7) % VOCAB).astype(np.int64)


def embedding_host() -> torch.Tensor:
    return (torch.arange(VOCAB * HIDDEN, dtype=torch.float32).view(VOCAB, HIDDEN) % 17) - 8.0


def main(steps: int = 32) -> None:
    device = torch.device("cuda")
    embedding = embedding_host().to(device)
    head = torch.ones(HIDDEN, dtype=torch.float32, device=device)
    inputs = [torch.empty(MAX_TOKENS, dtype=torch.int64, pin_memory=True) for _ in range(2)]
    copied: list[torch.cuda.Event | None] = [None, None]  # after the copy that last read inputs[b]
    outputs = torch.empty(MAX_TOKENS, dtype=torch.float32, pin_memory=True)
    dev_tokens = torch.empty(MAX_TOKENS, dtype=torch.int64, device=device)
    results: list[np.ndarray] = []

    tokens = step_tokens(0)
    inputs[0].numpy()[:len(tokens)] = tokens
    for step in range(steps):
        n, b = len(tokens), step % 2
        dev_tokens[:n].copy_(inputs[b][:n], non_blocking=True)
        event = torch.cuda.Event()
        event.record()  # on the stream that did the copy, right after it
        copied[b] = event
        logits = embedding.index_select(0, dev_tokens[:n]) @ head  # the "model"
        outputs[:n].copy_(logits, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        if step + 1 < steps:  # overlap: schedule the next step while this one runs
            tokens, other = step_tokens(step + 1), (step + 1) % 2
            previous = copied[other]
            if previous is not None:
                previous.synchronize()  # the copy that last read inputs[other] has run
            inputs[other].numpy()[:len(tokens)] = tokens
        done.synchronize()
        results.append(outputs.numpy()[:n].copy())

    torch.cuda.synchronize()
    table = embedding_host().sum(dim=1)
    for step, got in enumerate(results):
        want = table[torch.from_numpy(step_tokens(step))].numpy()
        if not np.array_equal(got, want):
            raise AssertionError(f"step {step}: model outputs {got.tolist()} != {want.tolist()}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=32)
    main(parser.parse_args().steps)
