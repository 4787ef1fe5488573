"""pytest wiring for tests/: the CUDA setup every GPU test expects, and examples/ on the path."""

from __future__ import annotations

import sys
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

