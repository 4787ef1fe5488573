"""The stream runtime: one interface, a CUDA backend and a deterministic simulator.

``make_runtime("sim")`` works everywhere; ``make_runtime("cuda", mode="controlled")`` enforces
the simulator's schedule choices on a GPU with gate kernels, ``mode="free"`` lets real timing
decide. ``"auto"`` picks cuda when a GPU is present.
"""

from __future__ import annotations

import torch

from racecheck.errors import RuntimeUsageError
from kvdevice.runtime.base import DeviceBuffer, Event, Hold, HostBuffer, Runtime, Stream
from racecheck.hb import HappensBefore, Hazard
from kvdevice.runtime.sim import EagerSchedule, LazySchedule, RandomSchedule, Schedule, SimRuntime

BACKENDS = ("auto", "cuda", "sim")
CUDA_MODES = ("controlled", "free")


def resolve_backend(backend: str) -> str:
    """``auto`` -> ``cuda`` when a GPU is present, else ``sim``; other names are checked."""
    if backend not in BACKENDS:
        raise RuntimeUsageError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "cuda" if torch.cuda.is_available() else "sim"
    if backend == "cuda" and not torch.cuda.is_available():
        raise RuntimeUsageError(
            "backend 'cuda' needs a CUDA GPU and torch.cuda.is_available() is False here; "
            "use backend 'sim' (or 'auto')"
        )
    return backend


def make_runtime(
    backend: str = "auto",
    *,
    mode: str = "controlled",
    device: int | str | torch.device | None = None,
    schedule: Schedule | None = None,
) -> Runtime:
    """Build a runtime. ``mode`` applies to cuda; ``schedule`` to sim."""
    backend = resolve_backend(backend)
    if backend == "sim":
        return SimRuntime(schedule=schedule)
    from kvdevice.runtime.cuda import CudaRuntime  # checks the mode (CUDA_MODES)

    return CudaRuntime(mode=mode, device=device)


__all__ = [
    "BACKENDS",
    "CUDA_MODES",
    "DeviceBuffer",
    "EagerSchedule",
    "Event",
    "HappensBefore",
    "Hazard",
    "Hold",
    "HostBuffer",
    "LazySchedule",
    "RandomSchedule",
    "Runtime",
    "Schedule",
    "SimRuntime",
    "Stream",
    "make_runtime",
    "resolve_backend",
]
