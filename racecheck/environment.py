"""The machine a finding was made on: GPU, driver, torch, triton, Python, Hypothesis, and the code.

Recorded in every trace (``environment``) and printed by every exported repro script, because a
race that shows on one driver or Triton version and not on another is still a lead; and in every
benchmark's data file, where ``commit`` says which code a figure was measured on (the checkout's
commit, ``+changes`` when its tracked files differ from it; None outside a git checkout).

Example::

    describe(environment())   # 'NVIDIA H200, driver 580.159.04, torch 2.11.0+cu130, triton 3.6.0, python 3.12.3'
"""

from __future__ import annotations

import functools
import platform
import shutil
import subprocess
from pathlib import Path

import torch


@functools.lru_cache(maxsize=1)
def _driver_version() -> str | None:
    # torch does not expose the driver version; nvidia-smi does when it is installed.
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0] if out.strip() else None


def environment(probe: bool = True) -> dict[str, str | None]:
    """Versions and hardware of this process, as plain JSON values (a fresh copy each call).

    ``probe=False``: never start the GPU probe (CUDA's initialisation and ``nvidia-smi``, which
    take seconds on a busy GPU): what is known already, else the versions with the GPU and driver
    marked not probed. What a trace saved after Ctrl-C records, so the run stops promptly."""
    if probe or _environment.cache_info().currsize:
        return dict(_environment())
    return {**_versions(), "gpu": None, "driver": None, "gpu_probed": False,
            "commit": _commit() if _commit.cache_info().currsize else None}


@functools.lru_cache(maxsize=1)
def _environment() -> dict[str, str | None]:
    # Computed once: the journal writes it with every op of a cuda run.
    cuda = torch.cuda.is_available()
    return {
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "driver": _driver_version() if cuda else None,
        **_versions(),
        "commit": _commit(),
    }


def _versions() -> dict[str, str | None]:
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:  # pragma: no cover - triton is a dependency
        triton_version = None
    try:
        import hypothesis

        hypothesis_version: str | None = hypothesis.__version__
    except ImportError:  # exported scripts run without Hypothesis
        hypothesis_version = None
    return {
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "hypothesis": hypothesis_version,
        "platform": platform.platform(),
    }


@functools.lru_cache(maxsize=1)
def _commit() -> str | None:
    """This code's commit, with ``+changes`` when tracked files were changed since (None: no git checkout)."""
    root = Path(__file__).resolve().parent.parent
    if shutil.which("git") is None or not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        changed = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}+changes" if changed else head or None


def describe(env: dict[str, str | None] | None) -> str:
    """One line for a person: GPU and driver (or 'no GPU'), then the library versions."""
    if not env:
        return "unknown (the trace did not record its environment)"
    if env.get("gpu_probed") is False:
        return (f"GPU not recorded (saved after an interruption), torch {env.get('torch')}, triton {env.get('triton')}, "
                f"python {env.get('python')}")
    gpu = f"{env['gpu']}, driver {env.get('driver') or '?'}" if env.get("gpu") else "no GPU"
    return f"{gpu}, torch {env.get('torch')}, triton {env.get('triton')}, python {env.get('python')}"
