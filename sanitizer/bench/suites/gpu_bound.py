"""A GPU-bound test suite for the sanitizer's overhead: few ops, each a large kernel (fp32 matmuls of
8192 x 8192, about 20 ms each on an H200)."""

import pytest
import torch

SIZE = 8192


@pytest.mark.parametrize("case", range(12))
def test_matmul_chain(case: int) -> None:
    a = torch.randn(SIZE, SIZE, device="cuda", dtype=torch.float32)
    b = torch.randn(SIZE, SIZE, device="cuda", dtype=torch.float32)
    for _ in range(16):
        a = torch.nn.functional.normalize(a @ b, dim=1)
    staged = torch.empty(SIZE, dtype=torch.float32, pin_memory=True)
    staged.copy_(a[0], non_blocking=True)
    torch.cuda.synchronize()
    assert torch.isfinite(staged.float()).all()
