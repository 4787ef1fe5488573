"""vLLM #36013: the runner reads num_accepted_tokens_cpu before its device-to-host copy has landed. RACY (host-read-vs-pending-copy).

Upstream: with speculative decoding, vLLM's GPU model runner copies the number of accepted draft
tokens per request from the device into the pinned ``num_accepted_tokens_cpu`` buffer with
``non_blocking=True`` at the end of a step, and reads it through the buffer's numpy view while it
builds the next step's attention metadata. Async scheduling deliberately adds no synchronisation
between the two, so the host could read the buffer before the copy had written it: hybrid (Mamba)
models with spec decoding scheduled from stale counts. #36013 records a CUDA event after the copy
and synchronizes it before the read.

Here each step reads the previous step's accepted counts through a numpy view taken once (as
vLLM's ``CpuGpuBuffer.np``), advances the host's per-request sequence lengths by them, runs the
"verifier" on the device and queues the copy of this step's counts. The read
``accepted = self.num_accepted_tokens.np[:num_reqs].copy()`` races with the previous step's
queued ``self.num_accepted_tokens.cpu[:num_reqs].copy_(..., non_blocking=True)``.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

SLEEP_CYCLES = 20_000_000  # about 10 ms of torch.cuda._sleep on an H200
NUM_REQS = 8
NUM_SPEC_TOKENS = 3  # draft tokens proposed per request per step: 0..3 of them get accepted


class CpuGpuBuffer:
    """A pinned host tensor, its numpy view (taken once) and a device tensor of the same shape."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.cpu = torch.zeros(size, dtype=dtype, pin_memory=True)
        self.np = self.cpu.numpy()
        self.gpu = torch.zeros(size, dtype=dtype, device=device)


def accepted_counts(step: int) -> np.ndarray:
    """What the verifier accepts at ``step`` for each request: differs from the step before everywhere."""
    return ((np.arange(NUM_REQS) + step) % (NUM_SPEC_TOKENS + 1)).astype(np.int32)


class ModelRunner:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.num_accepted_tokens = CpuGpuBuffer(NUM_REQS, torch.int32, device)
        self.num_accepted_tokens.np[:] = 0  # before any step: nothing accepted yet
        self.seq_lens = np.full(NUM_REQS, 16, dtype=np.int64)  # host bookkeeping
        self.req_ids = torch.arange(NUM_REQS, dtype=torch.int32, device=device)
        self.history: list[np.ndarray] = []

    def execute_model(self, step: int, sleep: bool) -> None:
        num_reqs = NUM_REQS
        # _build_attention_metadata: the previous step's accepted counts, read on the host.
        accepted = self.num_accepted_tokens.np[:num_reqs].copy()  # race: later
        self.history.append(accepted)
        self.seq_lens[:num_reqs] += accepted + 1
        # The forward pass and the rejection sampler, on the device: counts for this step.
        counts = torch.remainder(self.req_ids + step, NUM_SPEC_TOKENS + 1)
        self.num_accepted_tokens.gpu[:num_reqs].copy_(counts)
        # _update_states_after_model_execute: the counts go back to the host for the next step.
        if sleep:
            torch.cuda._sleep(SLEEP_CYCLES)  # the stream is busy: the copy below lands ~10 ms from now
        self.num_accepted_tokens.cpu[:num_reqs].copy_(self.num_accepted_tokens.gpu[:num_reqs], non_blocking=True)  # race: queued


def main(steps: int = 16, sleep: bool = False) -> None:
    runner = ModelRunner(torch.device("cuda"))
    for step in range(steps):
        runner.execute_model(step, sleep)

    torch.cuda.synchronize()
    seq_lens = np.full(NUM_REQS, 16, dtype=np.int64)
    for step, got in enumerate(runner.history):
        want = accepted_counts(step - 1) if step > 0 else np.zeros(NUM_REQS, dtype=np.int32)
        if not np.array_equal(got, want):
            raise AssertionError(f"step {step}: the scheduler read accepted counts {got.tolist()}, but step "
                                 f"{step - 1} accepted {want.tolist()} (read before the copy landed)")
        seq_lens += want + 1
    if not np.array_equal(runner.seq_lens, seq_lens):
        raise AssertionError(f"sequence lengths {runner.seq_lens.tolist()}, want {seq_lens.tolist()}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--sleep", action="store_true", help="delay the device so the race shows as wrong values")
    args = parser.parse_args()
    main(args.steps, args.sleep)
