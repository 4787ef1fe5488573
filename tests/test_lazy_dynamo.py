"""Our dispatch modes leave ``torch._dynamo`` unimported until the program imports it.

torch wraps a dispatch mode's handler in ``torch._disable_dynamo`` by default, which imports
``torch._dynamo`` at the first op: 4.5 s of a 16 s fuzz campaign on the H100 image (its profile,
2026-12). Each check runs in a fresh interpreter: this one may have imported dynamo already.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_lazy_mode_runs_ops_without_importing_dynamo_and_wraps_itself_once_the_program_does():
    out = _run("""
        import sys, torch
        from racecheck.lazy_dynamo import LazyDynamoMode, guard_once_dynamo_loaded

        class Mode(LazyDynamoMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                guard_once_dynamo_loaded(Mode)
                return func(*args, **(kwargs or {}))

        unwrapped = Mode.__dict__["__torch_dispatch__"]
        with Mode():
            torch.ones(3).add(1)
        print("torch._dynamo" in sys.modules, Mode.__dict__["__torch_dispatch__"] is unwrapped)
        import torch._dynamo  # the program's torch.compile
        with Mode():
            torch.ones(3).add(1)   # this op wraps the handler; the next ones go through the wrapper
            assert int(torch.ones(3).add(1).sum()) == 6
        print(Mode.__dict__["__torch_dispatch__"] is unwrapped, Mode._dynamo_guarded)
    """)
    assert out.splitlines() == ["False True", "False True"]


@pytest.mark.parametrize("module, name", [("kvdevice.intercept.cuda_ops", "CudaOps"),
                                          ("sanitizer.dynamo_guard", "SanitizerMode")])
def test_the_fuzzers_and_the_sanitizers_modes_are_lazy(module, name):
    out = _run(f"""
        import sys, torch
        from {module} import {name} as Mode
        from racecheck.lazy_dynamo import LazyDynamoMode
        print(issubclass(Mode, LazyDynamoMode), Mode._should_skip_dynamo(), "torch._dynamo" in sys.modules)
    """)
    assert out == "True False False"


def test_the_fuzzers_cuda_mode_runs_an_op_without_importing_dynamo():
    # The mode as a CUDA campaign enters it, on host tensors (nothing here is cuda, so each op is
    # handed on): what the old mode's first op imported.
    out = _run("""
        import sys, torch
        from types import SimpleNamespace
        from kvdevice.intercept.cuda_ops import CudaOps
        with CudaOps(SimpleNamespace(share=SimpleNamespace(recorded=set()))):
            torch.ones(3).add(1)
        print("torch._dynamo" in sys.modules)
    """)
    assert out == "False"
