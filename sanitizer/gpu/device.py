"""What the observer asks of CUDA, in one place: which tensors are device memory, which host
memory is pinned, which stream the calling thread is on, whether it is capturing a CUDA graph.

The observer's logic never calls ``torch.cuda`` itself for these; it asks a :class:`CudaDevice`.
Tests on a machine without a GPU hand it a stand-in that calls some CPU tensors device memory
(sanitizer/gpu/standin.py), so the observer's race logic runs in CI as it runs on a GPU.
"""

from __future__ import annotations

from typing import Any

import torch


class CudaDevice:
    """The real thing: torch's CUDA."""

    name = "cuda"

    def is_device(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cuda

    def device_index(self, tensor: torch.Tensor | None) -> int:
        if tensor is not None and tensor.is_cuda:
            return tensor.device.index or 0
        return torch.cuda.current_device()

    def current_stream(self, index: int | None = None) -> int:
        """The calling thread's current stream (``cudaStream_t``) on device ``index``."""
        index = torch.cuda.current_device() if index is None else index
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        return int(raw(index)) if raw is not None else int(torch.cuda.current_stream(index).cuda_stream)

    def stream_object(self, index: int | None = None) -> Any:
        """The calling thread's current stream as a ``torch.cuda.Stream`` (force mode's gates)."""
        return torch.cuda.current_stream(index)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        try:
            return bool(tensor.is_pinned())
        except RuntimeError:
            return False

    def adopt(self, tensor: torch.Tensor) -> None:
        """``tensor`` is the fresh output of a device op (only a stand-in needs to be told)."""

    def allocation_at(self, address: int, size: int) -> int | None:
        """The first byte of the caching allocator's live block holding ``[address, address + size)``
        (a custom op's raw access, :mod:`sanitizer.gpu.custom`), or None."""
        for segment in torch.cuda.memory_snapshot():
            start = int(segment["address"])
            for block in segment.get("blocks", ()):
                begin, start = start, start + int(block["size"])
                if block.get("state") == "active_allocated" and begin <= address and address + size <= start:
                    return begin
        return None

    def private_stream(self) -> Any:
        """A stream of the sanitizer's own, for reading an index tensor once its writer is done."""
        return torch.cuda.Stream()

    def read_back(self, tensor: torch.Tensor, stream: Any) -> torch.Tensor:
        """``tensor``'s values on the host, copied on ``stream`` (which waits for nothing else)."""
        with torch.cuda.stream(stream):
            return tensor.to("cpu")
