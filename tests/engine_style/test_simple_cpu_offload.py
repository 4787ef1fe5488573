"""SimpleCPUOffload's copy path (examples/simple_cpu_offload_dma.py: ``DmaCopyBackend`` and
``copy_blocks``, ``cuMemcpyBatchAsync`` through ``cuda.bindings``), tested as vLLM tests its KV
offload workers: pytest, parametrized, caches written by a model step on a stream of its own,
copies launched as the worker launches them, every job's event polled, the destination checked.

``ENGINE_STYLE_PLANTED_RACE=1`` launches stores without the compute stream's event, as before
vLLM #46278. Needs cuda-bindings (an engine's environment has it); on the simulator the sanitizer
follows the driver call."""

import os
import time

import pytest
import torch

pytest.importorskip("cuda.bindings.driver", reason="cuda-bindings is not installed (vLLM's environment has it)")

from examples.simple_cpu_offload_dma import DmaCopyBackend  # noqa: E402

RACY = os.environ.get("ENGINE_STYLE_PLANTED_RACE") == "1"


def poll(backend: DmaCopyBackend, jobs: set[int], seconds: float = 60.0) -> None:
    """The scheduler's polling of the workers' events until ``jobs`` are done, a step apart. Bounded
    by time, not by a count of polls: on an H100 under ``--kvz-sanitize`` the copy thread's first
    launch took longer than 100,000 busy polls, and the race-free test failed."""
    done: set[int] = set()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done |= {job_id for job_id, event in list(backend.events) if event.query()}
        if jobs <= done or not backend.thread.is_alive():
            break
        time.sleep(0.001)  # the next scheduler step
    assert jobs <= done, f"jobs {sorted(jobs - done)} never finished (copy thread error: {backend.error!r})"


@pytest.mark.parametrize("num_blocks", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_stores_copy_what_the_model_step_wrote(num_blocks: int, dtype: torch.dtype) -> None:
    gpu = torch.zeros(num_blocks, 64, dtype=dtype, device="cuda")
    cpu = torch.zeros(num_blocks, 64, dtype=dtype, pin_memory=True)
    backend = DmaCopyBackend([gpu], [cpu])
    compute = torch.cuda.Stream()
    compute.wait_stream(torch.cuda.current_stream())
    try:
        for block in range(num_blocks):
            with torch.cuda.stream(compute):
                gpu[block].fill_(block + 1.0)  # race: queued
            wait = None
            if not RACY:
                wait = torch.Event()
                wait.record(compute)
            backend.launch_copy(block, [block], [block], True, wait)
        poll(backend, set(range(num_blocks)))
    finally:
        backend.shutdown()
    assert cpu[:, 0].tolist() == [float(block + 1) for block in range(num_blocks)]


@torch.inference_mode()
def test_a_load_copies_the_pool_back_into_other_blocks() -> None:
    gpu = torch.zeros(8, 64, device="cuda")
    cpu = torch.arange(8 * 64, dtype=torch.float32).reshape(8, 64).pin_memory()
    backend = DmaCopyBackend([gpu], [cpu])
    try:
        wait = torch.Event()
        wait.record(torch.cuda.current_stream())
        backend.launch_copy(0, [1, 2], [5, 6], False, wait)
        poll(backend, {0})
    finally:
        backend.shutdown()
    torch.testing.assert_close(gpu[5:7].cpu(), cpu[1:3])
