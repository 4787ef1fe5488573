"""Async scheduling with ONE pinned input buffer. RACY (the vLLM #48085 hazard).

Step N's token ids are copied H2D non-blocking from the pinned ``inputs`` buffer and consumed by
the model kernel; while that is still queued the scheduler already prepares step N+1 by writing
``inputs.numpy()[:n] = ...`` into the SAME buffer, before it waits on step N's ``done`` event.
That host write races with step N's pending ``dev_tokens[:n].copy_(inputs[:n], non_blocking=True)``.
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
    inputs = torch.empty(MAX_TOKENS, dtype=torch.int64, pin_memory=True)  # one buffer for every step
    outputs = torch.empty(MAX_TOKENS, dtype=torch.float32, pin_memory=True)
    dev_tokens = torch.empty(MAX_TOKENS, dtype=torch.int64, device=device)
    results: list[np.ndarray] = []

    tokens = step_tokens(0)
    inputs.numpy()[:len(tokens)] = tokens
    for step in range(steps):
        n = len(tokens)
        dev_tokens[:n].copy_(inputs[:n], non_blocking=True)  # race: queued
        logits = embedding.index_select(0, dev_tokens[:n]) @ head  # the "model"
        outputs[:n].copy_(logits, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        if step + 1 < steps:  # overlap: schedule the next step while this one runs
            tokens = step_tokens(step + 1)
            inputs.numpy()[:len(tokens)] = tokens  # RACE: step's H2D copy of inputs may still be queued  # race: later
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
