"""CUDA graph static input: the host rewrites a graph's static pinned input while the previous replay is pending. RACY (host-write-vs-pending-copy).

Upstream anchor (onnxruntime #32121, one public case of the class): a CUDA graph captures a
non-blocking host-to-device copy as a memcpy node that records the host address of its pinned
source; every replay re-reads whatever that memory holds when the replay actually runs. In
onnxruntime a recycled pinned staging block fed the next replay another inference's bytes (wrong
outputs); the fix keeps the block for the graph's lifetime. Engines that replay decode graphs from
static pinned inputs have the same hazard whenever the host refills the static input for step N+1
before step N's replay has run.

Here a decode step (a copy of the static pinned input ids to the device, an embedding gather and
a small "head") is captured with ``torch.cuda.graph`` after a warm-up on a side stream, and replayed
once per step; the host refills the static input for each step and moves on without waiting. The
host write ``static_input_ids_np[:] = step_tokens(step)`` races with the previous step's queued
``graph.replay()``, whose captured copy reads that memory.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

SLEEP_CYCLES = 20_000_000  # about 10 ms of torch.cuda._sleep on an H200
BATCH = 8
VOCAB = 128
HIDDEN = 16


def step_tokens(step: int) -> np.ndarray:
    """The batch's input token ids at ``step`` (every position changes every step)."""
    return ((np.arange(BATCH) * 11 + step * 7 + 1) % VOCAB).astype(np.int64)


def embedding_host() -> torch.Tensor:
    return (torch.arange(VOCAB * HIDDEN, dtype=torch.float32).view(VOCAB, HIDDEN) % 13) + 1.0


def main(steps: int = 16, sleep: bool = False) -> None:
    device = torch.device("cuda")
    embedding = embedding_host().to(device)
    head = torch.arange(HIDDEN, dtype=torch.float32, device=device)
    static_input_ids = torch.zeros(BATCH, dtype=torch.int64, pin_memory=True)  # the graph's static input
    static_input_ids_np = static_input_ids.numpy()
    input_ids = torch.zeros(BATCH, dtype=torch.int64, device=device)
    logits = torch.zeros(BATCH, dtype=torch.float32, device=device)
    outputs = torch.zeros(steps, BATCH, dtype=torch.float32, device=device)

    def decode_step() -> None:
        input_ids.copy_(static_input_ids, non_blocking=True)
        logits.copy_(embedding.index_select(0, input_ids) @ head)

    warmup = torch.cuda.Stream()
    warmup.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warmup):
        decode_step()
    torch.cuda.current_stream().wait_stream(warmup)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_step()
    torch.cuda.synchronize()

    for step in range(steps):
        static_input_ids_np[:] = step_tokens(step)  # race: later
        if sleep:
            torch.cuda._sleep(SLEEP_CYCLES)  # the stream is busy: the replay runs ~10 ms from now
        graph.replay()  # race: queued
        outputs[step].copy_(logits)

    torch.cuda.synchronize()
    got = outputs.cpu()
    table = embedding_host() @ torch.arange(HIDDEN, dtype=torch.float32)
    for step in range(steps):
        want = table[torch.from_numpy(step_tokens(step))]
        if not torch.equal(got[step], want):
            raise AssertionError(f"step {step}: the replay computed {got[step].tolist()}, want {want.tolist()} "
                                 f"(its captured copy read a later step's input ids)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--sleep", action="store_true", help="delay the device so the race shows as wrong values")
    args = parser.parse_args()
    main(args.steps, args.sleep)
