"""pytest wiring for tests/: the CUDA setup every GPU test expects, and examples/ on the path."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from racecheck.gate import request_hardware_queues

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def pytest_configure(config: pytest.Config) -> None:
    # Before any test touches CUDA: the controlled runtime's gated streams need their own
    # hardware queues, and the driver reads that once, when the context is created.
    request_hardware_queues()
    if str(EXAMPLES) not in sys.path:  # tests import the example zeroers as modules
        sys.path.insert(0, str(EXAMPLES))


@pytest.fixture(autouse=True)
def _give_cached_gpu_memory_back() -> Iterator[None]:
    """After a test that used the GPU, hand the memory torch's allocators cache back to CUDA.

    A dozen xdist workers share one GPU and its host's pinned memory; each worker's caching
    allocators keep what its largest test took (a 16 GiB sparse span, a campaign's caches) for the
    rest of the session, and a later test on another worker then runs out. Free, not a sync of
    anything the next test relies on: every test builds its own state.
    """
    yield
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    torch.cuda.empty_cache()
    host_empty = getattr(torch._C, "_host_emptyCache", None)
    if host_empty is not None:
        host_empty()
