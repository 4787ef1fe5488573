"""Whether a device argument, as a program spells one, names a CUDA device: ``"cuda"``,
``"cuda:1"``, a ``torch.device``, or an index (torch's factories and ``Tensor.to`` take a bare index
for a CUDA device). Both tools ask it of every op or constructor given a ``device=``."""

from __future__ import annotations

from typing import Any

import torch


def names_cuda(device: Any) -> bool:
    """Whether ``device`` names a CUDA device (None, a CPU device or anything torch refuses: no)."""
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if device is None:
        return False
    try:
        return torch.device(device).type == "cuda"
    except (RuntimeError, TypeError):
        return False


__all__ = ["names_cuda"]
