"""The CPU offloading handler that copies through a Triton kernel over address tables
(tests/triton_swap_offload.py), tested as vLLM tests its offloading handler: pytest, parametrized
over block counts and layouts, caches written by the model on the compute stream, one transfer,
``get_finished`` polled until it reports the job, the destination checked.

``ENGINE_STYLE_PLANTED_RACE=1`` makes the stores skip their wait for the compute stream (vLLM
#46278)."""

import os
import time

import pytest
import torch

from tests.triton_swap_offload import CpuGpuOffloadHandler, _pieces

RACY = os.environ.get("ENGINE_STYLE_PLANTED_RACE") == "1"
ROWS, WORDS = 2, 16  # kernel blocks per block, 4-byte words per row


def poll(handler: CpuGpuOffloadHandler, job: int, seconds: float = 60.0) -> None:
    """``get_finished()`` a step apart until it reports ``job``; bounded by time, not by a count of
    polls, which a tool's slower ops make too few (tests/engine_style/test_simple_cpu_offload.py)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if (job, True) in handler.get_finished():
            return
        time.sleep(0.001)  # the next scheduler step
    raise AssertionError(f"job {job} never finished")


@pytest.mark.parametrize("num_blocks", [4, 8])
@pytest.mark.parametrize("kv_outer", [True, False])
@torch.inference_mode()
def test_a_store_copies_the_blocks_the_model_wrote(num_blocks: int, kv_outer: bool) -> None:
    shape = (2, num_blocks * ROWS, WORDS) if kv_outer else (num_blocks * ROWS, 2, WORDS)
    kv = torch.zeros(shape, device="cuda")
    host = torch.zeros(shape, pin_memory=True)
    handler = CpuGpuOffloadHandler(_pieces(kv, kv_outer), _pieces(host, kv_outer), ROWS, store_waits=not RACY)
    blocks = list(range(1, num_blocks, 2))
    for block in blocks:
        rows = slice(block * ROWS, (block + 1) * ROWS)
        (kv[:, rows] if kv_outer else kv[rows]).fill_(block + 1.0)  # race: queued
    handler.store(1, blocks, list(range(len(blocks))))
    poll(handler, 1)
    handler.close()
    for slot, block in enumerate(blocks):
        rows = slice(slot * ROWS, (slot + 1) * ROWS)
        assert bool(((host[:, rows] if kv_outer else host[rows]) == block + 1.0).all()), (slot, block)


@torch.inference_mode()
def test_a_load_brings_the_slots_back_into_other_blocks() -> None:
    kv = torch.zeros((2, 8 * ROWS, WORDS), device="cuda")
    host = torch.arange(2 * 8 * ROWS * WORDS, dtype=torch.float32).reshape(2, 8 * ROWS, WORDS).pin_memory()
    handler = CpuGpuOffloadHandler(_pieces(kv, True), _pieces(host, True), ROWS)
    handler.load(2, [3], [5])
    poll(handler, 2)
    handler.close()
    torch.testing.assert_close(kv[:, 5 * ROWS:6 * ROWS].cpu(), host[:, 3 * ROWS:4 * ROWS])
