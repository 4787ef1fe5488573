"""Every run of a suite starts its tests on a GPU that is already set up.

CUDA's context, cuBLAS's handle and the first kernels' loading are paid once per process. Left to
the tests, the first test pays them in a plain run, while ``--kvz-sanitize`` pays the context at
session start (its observer asks for the current stream): the plain run's tests alone would carry
a second of start-up the sanitized run's do not, and the tests-alone ratio would flatter the
sanitizer. Each run pays them here, before its first test, and the wall clock still counts them.
"""

import pytest
import torch


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    if torch.cuda.is_available():
        warm = torch.ones(64, 64, device="cuda")
        (warm @ warm).sum().item()  # the context, cuBLAS's handle, a reduction and a copy back
