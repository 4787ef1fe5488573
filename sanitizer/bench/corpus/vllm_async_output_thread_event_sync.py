"""vLLM async output thread: the main thread synchronizes the copy event before it reads the sampled token ids. FIXED (twin of vllm_async_output_thread_no_sync).

Upstream pattern: vLLM's ``AsyncGPUModelRunnerOutput`` moves sampled token ids to the host with a
non-blocking copy on a copy stream and records ``async_copy_ready_event``; ``get_output()`` calls
``async_copy_ready_event.synchronize()`` before it converts the ids with ``.tolist()``.

Same helper thread, the same copies and the same forced delay as the racy twin; the main thread
calls ``ready.synchronize()`` before it reads the host tensor.
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor

import torch

SLEEP_CYCLES = 20_000_000  # about 10 ms of torch.cuda._sleep on an H200
NUM_REQS = 8
VOCAB = 32000


def sampled_tokens(step: int) -> list[int]:
    """What the sampler picks at ``step`` (never zero, never another step's ids)."""
    return [1 + (step * 1000 + 37 * i) % (VOCAB - 1) for i in range(NUM_REQS)]


class AsyncOutputCopier:
    """Queues the device-to-host copy of sampled token ids from a helper thread."""

    def __init__(self, main_stream: torch.cuda.Stream, sleep: bool) -> None:
        self.main_stream = main_stream
        self.copy_stream = torch.cuda.Stream()
        self.sleep = sleep
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="async_output")

    def _copy(self, sampled: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        with torch.cuda.stream(self.copy_stream):  # in the helper thread
            self.copy_stream.wait_stream(self.main_stream)  # the sampler has written the ids: correct
            if self.sleep:
                torch.cuda._sleep(SLEEP_CYCLES)  # the copy stream is busy: the copy runs ~10 ms from now
            sampled_cpu = sampled.to("cpu", non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.copy_stream)
        return sampled_cpu, ready

    def submit(self, sampled: torch.Tensor):  # -> Future[tuple[Tensor, Event]]
        return self.executor.submit(self._copy, sampled)

    def close(self) -> None:
        self.executor.shutdown(wait=True)


def main(steps: int = 16, sleep: bool = False) -> None:
    device = torch.device("cuda")
    main_stream = torch.cuda.current_stream()
    request_ids = torch.arange(NUM_REQS, dtype=torch.int64, device=device)
    in_flight: list[torch.Tensor] = []  # a Python reference keeps each step's ids alive (no record_stream)
    copier = AsyncOutputCopier(main_stream, sleep)
    outputs: list[list[int]] = []
    try:
        for step in range(steps):
            # The sampler, on the main stream: this step's token ids.
            sampled = torch.remainder(request_ids * 37 + step * 1000, VOCAB - 1).add_(1)
            in_flight.append(sampled)
            future = copier.submit(sampled)
            sampled_cpu, ready = future.result()  # the helper has queued the copy and recorded the event
            ready.synchronize()  # the copy has landed
            outputs.append(sampled_cpu.tolist())
    finally:
        copier.close()

    torch.cuda.synchronize()
    for step, got in enumerate(outputs):
        want = sampled_tokens(step)
        if got != want:
            raise AssertionError(f"step {step}: the engine output token ids {got}, want {want} "
                                 f"(read before the device-to-host copy had landed)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--sleep", action="store_true", help="delay the device so the race shows as wrong values")
    args = parser.parse_args()
    main(args.steps, args.sleep)
