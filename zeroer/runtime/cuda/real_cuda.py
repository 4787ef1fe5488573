"""``torch.cuda``'s own streams, events and device calls, captured when the runtime is imported.

While an intercepted zeroer runs, ``torch.cuda.Stream``, ``Event``, ``stream``, ``synchronize``
and friends are stand-ins that call into the runtime (:mod:`zeroer.intercept.cuda_api`); the
runtime must keep reaching CUDA itself, so it uses these names, never ``torch.cuda.<name>``.
"""

from __future__ import annotations

import torch

Event = torch.cuda.Event
Stream = torch.cuda.Stream
stream = torch.cuda.stream
device = torch.cuda.device
synchronize = torch.cuda.synchronize
current_device = torch.cuda.current_device
current_stream = torch.cuda.current_stream
device_count = torch.cuda.device_count
is_available = torch.cuda.is_available
is_initialized = torch.cuda.is_initialized
_sleep = torch.cuda._sleep
