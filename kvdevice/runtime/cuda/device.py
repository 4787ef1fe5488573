"""Which GPU a cuda runtime runs on: ``device`` as the user gave it, checked against the machine.

Pure (the device count and the current device are arguments), so every message is testable on a
machine without a GPU.

Example::

    assert resolve_device("cuda:1", count=2, current=0) == torch.device("cuda", 1)
"""

from __future__ import annotations

import torch

from racecheck.errors import RuntimeUsageError


def resolve_device(device: int | str | torch.device | None, count: int, current: int) -> torch.device:
    """``device`` as ``torch.device("cuda", index)``; ``None`` or ``"cuda"`` mean ``current``.

    ``count`` is ``torch.cuda.device_count()``; pure so that its messages are testable on CPU.
    """
    if count < 1:
        raise RuntimeUsageError(
            "backend 'cuda' needs a CUDA GPU and none is visible here; use backend 'sim' (or 'auto')"
        )
    valid = f"valid: 0..{count - 1}"
    if device is None:
        index = current
    elif isinstance(device, bool):
        raise RuntimeUsageError(f"device {device!r} is not a device; pass a cuda index ({valid}), 'cuda:N' or None")
    elif isinstance(device, int):
        index = device
    else:
        try:
            parsed = torch.device(device)
        except (RuntimeError, TypeError):
            raise RuntimeUsageError(
                f"device {device!r} is not a device; pass a cuda index ({valid}), 'cuda:N' or None"
            ) from None
        if parsed.type != "cuda":
            raise RuntimeUsageError(
                f"device {device!r} is not a cuda device; pass a cuda index ({valid}), 'cuda:N' or None, "
                f"or use backend 'sim' for CPU"
            )
        index = current if parsed.index is None else parsed.index
    if not 0 <= index < count:
        raise RuntimeUsageError(
            f"cuda device {index} does not exist: this machine has {count} ({valid}); "
            f"pass one of those or None for the current device"
        )
    return torch.device("cuda", index)
