"""``torch.cuda``'s own streams, events and device calls, captured when the runtime is imported.

While an intercepted zeroer runs, ``torch.cuda.Stream``, ``Event``, ``stream``, ``current_stream``,
``set_stream``, ``synchronize`` and friends are stand-ins that call into the runtime
(:mod:`kvdevice.intercept.cuda_api`); the runtime must keep reaching CUDA itself, so it uses these
names, never ``torch.cuda.<name>``. :func:`stream` is not torch's ``torch.cuda.stream``: that one
looks ``torch.cuda.current_stream`` and ``torch.cuda.set_stream`` up when it is entered, so it
would reach the stand-ins; this one calls torch's C functions directly.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.cuda import (Event, Stream, _sleep, current_device, current_stream, device, device_count,
                        is_available, is_initialized, synchronize)


class stream:  # noqa: N801 - named as the torch.cuda.stream it replaces
    """``with stream(s):`` makes ``s`` (a ``torch.cuda.Stream``) the current stream of its device
    inside, and restores that device's previous stream on exit."""

    __slots__ = ("_stream", "_previous")

    def __init__(self, s: Any) -> None:
        self._stream = s

    def __enter__(self) -> Any:
        s = self._stream
        if s is None:
            return None
        self._previous = torch._C._cuda_getCurrentStream(s.device_index)  # (stream_id, device_index, device_type)
        torch._C._cuda_setStream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)
        return s

    def __exit__(self, *exc: object) -> None:
        if self._stream is None:
            return
        stream_id, device_index, device_type = self._previous
        torch._C._cuda_setStream(stream_id=stream_id, device_index=device_index, device_type=device_type)
