"""The CUDA backend: real streams, events, pinned memory and copies on one GPU, in two modes.

Two runtimes over shared parts, one module each:

* :mod:`~kvdevice.runtime.cuda.controlled` (``mode="controlled"``, ``scheduled = True``): every op
  is queued in the simulator's model and issued behind a closed gate kernel, and runs when the
  model executes it; the GPU takes exactly the simulator's scheduling decisions.
* :mod:`~kvdevice.runtime.cuda.free` (``mode="free"``, ``scheduled = False``): every op goes
  straight to its stream and real timing decides; only holds are gated. ``checked=False`` (free
  mode only) strips the bookkeeping, for ``python -m fuzz.bench.kernel``.
* :mod:`~kvdevice.runtime.cuda.common`: :class:`CudaRuntimeBase`, what both share (device, pool
  streams, events, protected host memory and its allocator clocks, the watchdog, teardown);
  :mod:`~kvdevice.runtime.cuda.arena` the unprotected pinned memory, :mod:`~kvdevice.runtime.cuda.device`
  the device argument, :mod:`~racecheck.gate` the gate kernel, its flags and watchdog.

:func:`CudaRuntime` builds the runtime of a mode (``make_runtime("cuda", mode=...)`` calls it);
``isinstance(rt, CudaRuntimeBase)`` tells a cuda runtime of either mode.

Importing this package needs neither a GPU nor triton, and changes nothing in the process (the
controlled runtime asks for hardware queues when it is built:
:func:`~racecheck.gate.request_hardware_queues`).

Example (needs a GPU)::

    from kvdevice.runtime.cuda import CudaRuntime, FreeCudaRuntime
    rt = CudaRuntime(mode="free")
    assert isinstance(rt, FreeCudaRuntime) and not rt.scheduled
    rt.close()
"""

from __future__ import annotations

import torch

from racecheck.errors import RuntimeUsageError
from kvdevice.runtime.cuda.arena import ARENA_ALIGN, ARENA_BYTES, PinnedArena
from kvdevice.runtime.cuda.common import DEFAULT_TIMEOUT_S, POLL_SPIN_S, CudaRuntimeBase
from kvdevice.runtime.cuda.controlled import ControlledCudaRuntime
from kvdevice.runtime.cuda.device import resolve_device
from kvdevice.runtime.cuda.free import DELAY_CYCLES_PER_UNIT, FreeCudaRuntime

MODES = ("controlled", "free")


def CudaRuntime(  # noqa: N802 - named like the class it stood for, so callers read the same
    mode: str = "controlled",
    device: int | str | torch.device | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    checked: bool = True,
) -> CudaRuntimeBase:
    """The cuda runtime of ``mode``: a :class:`ControlledCudaRuntime` or a :class:`FreeCudaRuntime`.

    ``device`` is a cuda index, ``"cuda:N"``, a ``torch.device`` or None (the current device);
    ``timeout_s`` bounds one gated op or one guarded host call; ``checked=False`` needs
    ``mode="free"``. Bad arguments raise :class:`~zeroer.errors.RuntimeUsageError`, a missing GPU
    or triton too.

    Example (needs a GPU)::

        rt = CudaRuntime(mode="controlled", timeout_s=5.0)
        assert isinstance(rt, ControlledCudaRuntime) and rt.scheduled
    """
    if mode not in MODES:
        raise RuntimeUsageError(f"unknown cuda mode {mode!r}; choose one of {', '.join(MODES)}")
    runtime = ControlledCudaRuntime if mode == "controlled" else FreeCudaRuntime
    return runtime(device, timeout_s=timeout_s, checked=checked)


__all__ = [
    "ARENA_ALIGN",
    "ARENA_BYTES",
    "DEFAULT_TIMEOUT_S",
    "DELAY_CYCLES_PER_UNIT",
    "MODES",
    "POLL_SPIN_S",
    "ControlledCudaRuntime",
    "CudaRuntime",
    "CudaRuntimeBase",
    "FreeCudaRuntime",
    "PinnedArena",
    "resolve_device",
]
