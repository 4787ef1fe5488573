"""A launch-bound test suite for the sanitizer's overhead: many tiny ops, pinned staging per step."""

import pytest
import torch


@pytest.mark.parametrize("case", range(12))
def test_small_steps(case: int) -> None:
    state = torch.zeros(64, device="cuda")
    ids = torch.empty(16, dtype=torch.int64, device="cuda")
    side = torch.cuda.Stream()
    for step in range(150):
        staged = torch.tensor(list(range(step % 7, step % 7 + 16)), dtype=torch.int64).pin_memory()
        ids.copy_(staged, non_blocking=True)
        state.index_add_(0, ids, torch.ones(16, device="cuda"))
        state.mul_(0.5).add_(1.0)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            total = state.sum()
        torch.cuda.current_stream().wait_stream(side)
        state.sub_(total * 0)
    torch.cuda.synchronize()
    assert torch.isfinite(state).all()
