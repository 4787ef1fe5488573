"""The CUDA stand-in for the tests: :class:`FakeCuda` (sanitizer/gpu/standin.py, which the op-cost
benchmark shares) and :class:`RealCuda`, the same calls on a GPU, so the same tests run there too."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from sanitizer.gpu.standin import FakeCuda

__all__ = ["FakeCuda", "RealCuda", "kinds", "observing"]


@contextlib.contextmanager
def observing(cuda: Any) -> Iterator[Any]:
    """The sanitizer's observer on ``cuda`` (the stand-in or :class:`RealCuda`), started; stopped on
    the way out unless the test stopped it."""
    from sanitizer.gpu.observer import Observer

    observer = Observer(device=cuda.adapter())
    cuda.obs = observer
    observer.start()
    try:
        yield observer
    finally:
        if observer._started:
            observer.stop()


def kinds(races: list) -> list[str]:
    """The kinds of ``races``, sorted, each once."""
    return sorted({race.kind for race in races})


class RealCuda:
    """The same calls on a real GPU (the tests run on both where there is one): device memory is
    CUDA memory, pinned memory is pinned, streams and events are torch's."""

    name = "cuda"

    def __init__(self) -> None:
        self.obs: Any = None

    def device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to("cuda")

    def pinned(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory()

    def new_stream(self) -> Any:
        return torch.cuda.Stream()

    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def record(self, stream: Any = None) -> Any:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, event: Any, stream: Any = None) -> None:
        (stream or torch.cuda.current_stream()).wait_event(event)

    def synchronize_event(self, event: Any) -> None:
        event.synchronize()

    def synchronize_stream(self, stream: Any) -> None:
        stream.synchronize()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def new_graph(self) -> Any:
        return torch.cuda.CUDAGraph()

    def capture(self, graph: Any) -> Any:
        return torch.cuda.graph(graph)

    def replay(self, graph: Any) -> None:
        graph.replay()

    def generic_types(self) -> Any:
        return contextlib.nullcontext()  # torch.Event and torch.Stream are CUDA's already

    def adapter(self) -> None:
        """The observer's device: its own (None: sanitizer.gpu.device.CudaDevice)."""
        return None
