"""A launch-bound test suite for the sanitizer's overhead: many tiny ops, pinned staging per step.

``step`` is also the loop of ``python -m sanitizer.bench.op_cost``, which times it op by op.
"""

import pytest
import torch


def step(state: torch.Tensor, ids: torch.Tensor, side: torch.cuda.Stream, index: int) -> None:
    """One step: stage 16 ids through pinned memory, scatter-add into ``state``, a few pointwise ops,
    a reduction on ``side`` ordered both ways with the current stream."""
    staged = torch.tensor(list(range(index % 7, index % 7 + 16)), dtype=torch.int64).pin_memory()
    ids.copy_(staged, non_blocking=True)
    state.index_add_(0, ids, torch.ones(16, device="cuda"))
    state.mul_(0.5).add_(1.0)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        total = state.sum()
    torch.cuda.current_stream().wait_stream(side)
    state.sub_(total * 0)


@pytest.mark.parametrize("case", range(12))
def test_small_steps(case: int) -> None:
    state = torch.zeros(64, device="cuda")
    ids = torch.empty(16, dtype=torch.int64, device="cuda")
    side = torch.cuda.Stream()
    for index in range(150):
        step(state, ids, side, index)
    torch.cuda.synchronize()
    assert torch.isfinite(state).all()
