"""The engine-style tests need CUDA: a GPU, or the sanitizer's simulator (``--kvz-sanitize
--kvz-sanitize-backend sim``), which answers ``torch.cuda.is_available()`` only while a test runs."""

import os

import pytest
import torch


@pytest.fixture(autouse=True)
def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: a GPU, or --kvz-sanitize --kvz-sanitize-backend sim")
    if os.environ.get("VLLM_OFFLOAD_COPY") == "swap_blocks" and not hasattr(torch.ops._C_cache_ops, "swap_blocks"):
        pytest.skip("VLLM_OFFLOAD_COPY=swap_blocks needs vLLM's _C extension, or a tool standing its op in")
