"""vLLM #24527: prepare_inputs_event guards the reused pinned input buffers. FIXED (twin of vllm_24527_reused_input_buffers).

Upstream (#24527, completed by #25279, #28706 and #31373): under async scheduling vLLM's runner
rewrote its persistent pinned input tensors for step N+1 while step N's non-blocking copies out of
them could still be queued. The fix, ``prepare_inputs_event``: the runner synchronizes it before it
touches the reused CPU tensors and records it after the copies out of them have been queued
(``synchronize_input_prep``), so step N+1's writes wait for step N's copies and nothing else.

Same runner and the same forced delay as the racy twin, with ``_prepare_inputs`` and the copies
inside ``synchronize_input_prep()``.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

import numpy as np
import torch

SLEEP_CYCLES = 20_000_000  # about 10 ms of torch.cuda._sleep on an H200
MAX_TOKENS = 16
VOCAB = 64
MAX_POSITIONS = 512
NUM_REQS = 4


class CpuGpuBuffer:
    """A pinned host tensor, its numpy view (taken once) and a device tensor of the same shape."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.cpu = torch.zeros(size, dtype=dtype, pin_memory=True)
        self.np = self.cpu.numpy()
        self.gpu = torch.zeros(size, dtype=dtype, device=device)

    def copy_to_gpu(self, n: int) -> torch.Tensor:
        return self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)


def scheduled(step: int) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, positions) of ``step``'s batch: every request decodes tokens, one to four each."""
    token_ids, positions = [], []
    for req in range(NUM_REQS):
        count = 1 + (req + step) % 4
        start = 10 * req + 3 * step  # the request's computed tokens so far
        positions += range(start, start + count)
        token_ids += [(7 * step + 5 * req + i) % VOCAB for i in range(count)]
    return np.array(token_ids, dtype=np.int64), np.array(positions, dtype=np.int64)


def token_table() -> torch.Tensor:
    return torch.arange(VOCAB, dtype=torch.float32) * 1000.0


def position_table() -> torch.Tensor:
    return torch.arange(MAX_POSITIONS, dtype=torch.float32)


class ModelRunner:
    def __init__(self, device: torch.device) -> None:
        self.input_ids = CpuGpuBuffer(MAX_TOKENS, torch.int64, device)
        self.positions = CpuGpuBuffer(MAX_TOKENS, torch.int64, device)
        self.embed_tokens = token_table().to(device)
        self.embed_positions = position_table().to(device)
        self.prepare_inputs_event = torch.cuda.Event()
        self.prepare_inputs_event.record()  # nothing to wait for before the first step

    @contextlib.contextmanager
    def synchronize_input_prep(self) -> Iterator[None]:
        """Around every use of the reused CPU tensors: the previous step's copies out of them have run
        before they are rewritten, and this step's copies are covered by the event recorded after."""
        self.prepare_inputs_event.synchronize()
        try:
            yield
        finally:
            self.prepare_inputs_event.record()

    def execute_model(self, step: int, out: torch.Tensor, sleep: bool) -> None:
        token_ids, positions = scheduled(step)
        num_tokens = len(token_ids)
        with self.synchronize_input_prep():
            # _prepare_inputs: the step's inputs go into the persistent CPU tensors.
            self.input_ids.np[:num_tokens] = token_ids
            self.positions.np[:num_tokens] = positions
            if sleep:
                torch.cuda._sleep(SLEEP_CYCLES)  # the stream is busy: the copies below run ~10 ms from now
            input_ids = self.input_ids.copy_to_gpu(num_tokens)
            pos = self.positions.copy_to_gpu(num_tokens)
        # The "model": each token's hidden state is its token and position embeddings.
        hidden = self.embed_tokens.index_select(0, input_ids) + self.embed_positions.index_select(0, pos)
        out[:num_tokens].copy_(hidden)


def main(steps: int = 16, sleep: bool = False) -> None:
    device = torch.device("cuda")
    runner = ModelRunner(device)
    outputs = torch.zeros(steps, MAX_TOKENS, device=device)
    for step in range(steps):  # async scheduling: step N+1 is prepared while step N runs
        runner.execute_model(step, outputs[step], sleep)

    torch.cuda.synchronize()
    got = outputs.cpu()
    tokens, places = token_table(), position_table()
    for step in range(steps):
        token_ids, positions = scheduled(step)
        n = len(token_ids)
        want = tokens[torch.from_numpy(token_ids)] + places[torch.from_numpy(positions)]
        if not torch.equal(got[step, :n], want):
            raise AssertionError(f"step {step}: hidden states {got[step, :n].tolist()} != {want.tolist()} "
                                 f"(the step ran on another step's input ids or positions)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--sleep", action="store_true", help="delay the device so the race shows as wrong values")
    args = parser.parse_args()
    main(args.steps, args.sleep)
