"""What the observer asks of CUDA, in one place: which tensors are device memory, which host
memory is pinned, which stream the calling thread is on, whether it is capturing a CUDA graph.

The observer's logic never calls ``torch.cuda`` itself for these; it asks a :class:`CudaDevice`.
Tests on a machine without a GPU hand it a stand-in that calls some CPU tensors device memory
(sanitizer/gpu/standin.py), so the observer's race logic runs in CI as it runs on a GPU.
"""

from __future__ import annotations

from typing import Any

import torch

from racecheck.placement import Placed
from racecheck.raw_copies import allocator_holding, memory_type

_CUDA = 1  # c10::DeviceType::CUDA, as a torch.Stream's device_type gives it
# The current stream's handle as an int, as Triton's launcher asks for it (no torch.cuda.Stream made);
# a CPU build of torch has none.
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class CudaDevice:
    """The real thing: torch's CUDA."""

    name = "cuda"

    def is_device(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cuda

    def device_index(self, tensor: torch.Tensor | None) -> int:
        if tensor is not None and tensor.is_cuda:
            return max(tensor.get_device(), 0)  # an int, without a torch.device made on every op
        return torch.cuda.current_device()

    def current_stream(self, index: int | None = None) -> int:
        """The calling thread's current stream (``cudaStream_t``) on device ``index``."""
        index = torch.cuda.current_device() if index is None else index
        return int(_RAW_STREAM(index)) if _RAW_STREAM is not None else int(torch.cuda.current_stream(index).cuda_stream)

    def event_handle(self, event: Any) -> int | None:
        """The ``cudaEvent_t`` torch's trace callbacks name ``event`` by (``torch.cuda.Event`` or the
        device-generic ``torch.Event``, whose ``event_id`` is c10's ``cudaEvent_t``; 0 until it is
        first recorded), or None for an event of another device."""
        handle = getattr(event, "cuda_event", None)
        if handle is None:
            device = getattr(event, "device", None)
            if getattr(device, "type", None) != "cuda":
                return None
            handle = event.event_id
        return int(handle)

    def stream_handle(self, stream: Any) -> int | None:
        """The ``cudaStream_t`` of ``stream`` (a ``torch.cuda.Stream``, or a device-generic
        ``torch.Stream``, whose ``stream_id`` is c10's packed id, not the handle), or None for a
        stream of another device."""
        handle = getattr(stream, "cuda_stream", None)
        if handle is None:
            if getattr(stream, "device_type", None) != _CUDA:
                return None
            # the same stream as a torch.cuda.Stream (unpacked from its ids: no stream is made)
            handle = torch.cuda.Stream(stream_id=stream.stream_id, device_index=stream.device_index,
                                       device_type=stream.device_type).cuda_stream
        return int(handle)

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

    def holding(self, start: int, end: int) -> Placed | None:
        """Device memory a raw access lies in (:class:`racecheck.placement.Memories`)."""
        return allocator_holding(start, end)

    def is_pageable(self, address: int, size: int) -> bool:
        """Whether ``[address, address + size)`` is plain host memory: in no block of the caching
        allocator, and neither pinned nor registered as the driver says (a custom op's raw access
        there is the host's, at the call: CUDA stages a copy from or to pageable memory before the
        call returns). False where the driver cannot be asked."""
        if self.holding(address, address + size) is not None:
            return False
        return memory_type(address) == "pageable" and memory_type(address + size - 1) == "pageable"

    def private_stream(self) -> Any:
        """A stream of the sanitizer's own, for reading an index tensor once its writer is done."""
        return torch.cuda.Stream()

    def read_back(self, tensor: torch.Tensor, stream: Any) -> torch.Tensor:
        """``tensor``'s values on the host, copied on ``stream`` (which waits for nothing else)."""
        with torch.cuda.stream(stream):
            return tensor.to("cpu")
