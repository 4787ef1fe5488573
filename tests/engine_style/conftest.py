"""The engine-style tests need CUDA: a GPU, or the sanitizer's simulator (``--kvz-sanitize
--kvz-sanitize-backend sim``), which answers ``torch.cuda.is_available()`` only while a test runs."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: a GPU, or --kvz-sanitize --kvz-sanitize-backend sim")
