"""CUDA graph static input: an event after each replay is synchronized before the host refills the static input. FIXED (twin of cuda_graph_static_input_rewritten).

Upstream anchor (onnxruntime #32121): a captured non-blocking copy reads its pinned host source
when each replay runs, not when the graph was captured or the replay was launched, so the host
must not change that memory until the replay that reads it has run.

Same graph, the same steps and the same forced delay as the racy twin: ``replayed`` is recorded
after each ``graph.replay()`` and synchronized before the host writes the next step's input ids.
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

    replayed: torch.cuda.Event | None = None  # after the replay that last read the static input
    for step in range(steps):
        if replayed is not None:
            replayed.synchronize()  # the previous replay has read the static input
        static_input_ids_np[:] = step_tokens(step)
        if sleep:
            torch.cuda._sleep(SLEEP_CYCLES)  # the stream is busy: the replay runs ~10 ms from now
        graph.replay()
        replayed = torch.cuda.Event()
        replayed.record()
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
