"""Whether a device argument, as a program spells one, names a CUDA device: ``"cuda"``,
``"cuda:1"``, a ``torch.device``, or an index (torch's factories and ``Tensor.to`` take a bare index
for a CUDA device). Both tools ask it of every op or constructor given a ``device=``."""

from __future__ import annotations

from typing import Any

import torch


def _device_type(device: Any) -> str | None:
    """``"cuda"``, ``"cpu"``...; None for None or anything torch refuses."""
    if isinstance(device, int) and not isinstance(device, bool):
        return "cuda"
    if device is None:
        return None
    try:
        return torch.device(device).type
    except (RuntimeError, TypeError):
        return None


def names_cuda(device: Any) -> bool:
    """Whether ``device`` names a CUDA device (None, a CPU device or anything torch refuses: no)."""
    return _device_type(device) == "cuda"


def names_host(device: Any) -> bool:
    """Whether ``device`` names the host, ``"cpu"`` (``torch.empty_like(gpu_t, device="cpu")``, a
    host mirror of a device tensor); None or anything torch refuses: no."""
    return _device_type(device) == "cpu"


__all__ = ["names_cuda", "names_host"]
