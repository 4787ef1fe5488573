"""Copies between raw addresses, made with torch ops: how the engines' op models move bytes.

An engine's transfer op (``sgl_kernel::transfer_kv_all_layer``, ``lmcache.c_ops.
multi_layer_block_kv_transfer``) is modelled as a list of raw copies ``(source, destination,
bytes)`` (:mod:`racecheck.engine_ops`). Where the program has no extension, kvzero's reference
implementation makes those copies itself: each address is placed in the memory it lies in (device
memory of a CUDA device, or host memory), each side is a uint8 tensor made over its bytes (host
memory through ``__array_interface__``, device memory through ``__cuda_array_interface__``), and
``destination.copy_(source, non_blocking=True)`` moves them, on the caller's current stream, in
order: the copies the extension's kernel would make, queued where its kernel would be. The same
code runs on a CPU (the simulator's device memory is CPU memory) and on a GPU.

The copies are the op's insides, as an extension's ``cudaMemcpyAsync`` calls are: no torch mode
sees them (each tool has declared what the op touches from its model already, and the fuzzer's
dispatch mode would queue each one as an op of its own).

Where an address cannot be placed (CUDA is running, the address is in no allocation torch knows,
and the driver cannot be asked), :class:`Unplaced` says so before any byte moves: never a guess
(a host copy at a device address would fault).

Example::

    src, dst = torch.arange(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
    copy_bytes([(src.data_ptr() + 2, dst.data_ptr(), 3)], Placement([src, dst]))
    assert dst.tolist() == [2, 3, 4, 0, 0, 0, 0, 0]
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence

import numpy as np
import torch
from torch.utils._mode_utils import no_dispatch

from racecheck.errors import KvzeroError
from racecheck.placement import Extents, Placed, place

CPU = torch.device("cpu")
Copies = Sequence[tuple[int, int, int]]  # (source address, destination address, bytes)


class Unplaced(KvzeroError, RuntimeError):
    """An address of a raw copy in memory kvzero cannot tell device from host memory."""

    user_fixable = True


class _HostBytes:
    """``nbytes`` of host memory at ``address``, as numpy sees an array (``__array_interface__``)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 3}


class _DeviceBytes:
    """``nbytes`` of device memory at ``address``, as torch takes a foreign CUDA array
    (``__cuda_array_interface__``, version 2: no stream, so torch synchronises nothing)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 2}


def byte_view(address: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over ``[address, address + nbytes)`` of ``device``'s memory (no copy)."""
    if device.type == "cpu":
        return torch.from_numpy(np.asarray(_HostBytes(int(address), int(nbytes))))
    return torch.as_tensor(_DeviceBytes(int(address), int(nbytes)), device=device)


class Placement:
    """Which memory an address lies in: the storages of the op's tensor arguments first (their
    device is the tensor's), then PyTorch's CUDA caching allocator, then the driver (through
    cuda-bindings, where installed). Without CUDA running, everything is host memory: the
    simulator's device memory is CPU memory."""

    def __init__(self, tensors: Iterable[torch.Tensor] = ()) -> None:
        with torch._C.DisableTorchFunction():
            self._known = Extents((s.data_ptr(), s.data_ptr() + s.nbytes(), t.device, None, "device") for t in tensors
                                  if t.device.type in ("cpu", "cuda") for s in (t.untyped_storage(),))
        self._segments: Extents | None = None

    def device_of(self, address: int, nbytes: int) -> torch.device:
        """The device whose memory holds ``[address, address + nbytes)`` (``cpu``: host memory)."""
        run = [(address, address + nbytes)]
        placed, _ = place(run, [self._known])
        if not placed and cuda_running():
            if self._segments is None:  # read once, at the first address no argument holds
                self._segments = Extents((start, end, device, None, "device") for start, end, device in allocator_segments())
            placed, _ = place(run, [self._segments])
            if not placed:
                return ask_driver(address, nbytes)
        return placed[0].memory if placed else CPU


def cuda_running() -> bool:
    """Whether this process has CUDA memory at all (a CPU build of torch, or CUDA never
    initialised: no)."""
    return hasattr(torch._C, "_cuda_memorySnapshot") and torch.cuda.is_initialized()


def allocator_segments() -> list[tuple[int, int, torch.device]]:
    """The device memory PyTorch's CUDA caching allocator holds now: (start, end, device)."""
    if not cuda_running():
        return []
    return [(int(s["address"]), int(s["address"]) + int(s["total_size"]), torch.device("cuda", int(s["device"])))
            for s in torch.cuda.memory_snapshot()]


def allocator_holding(start: int, end: int, cache: Container[int] = ()) -> Placed | None:
    """The bytes of ``[start, end)`` in the live block of PyTorch's CUDA caching allocator that holds
    ``start`` (a :class:`racecheck.placement.Memories` answer), the memory named by its first byte, where
    a tensor's storage starts; of kind ``cache`` where ``cache`` holds that byte."""
    for segment in torch.cuda.memory_snapshot():
        at = int(segment["address"])
        for block in segment.get("blocks", ()):
            begin = int(block.get("address", at))
            at = begin + int(block["size"])
            if block.get("state") == "active_allocated" and begin <= start < at:
                return Placed(begin, ("cudamem", begin), "cache" if begin in cache else "device", [(start, min(end, at))])
    return None


def memory_type(address: int) -> str | None:
    """What ``cudaPointerGetAttributes`` says ``address`` is: ``"device"`` (device or managed memory),
    ``"pinned"`` (pinned or registered host memory), ``"pageable"`` (host memory CUDA never saw), or
    None where cuda-bindings is not installed to ask."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        return None
    err, attributes = runtime.cudaPointerGetAttributes(address)
    if int(err) != 0:
        runtime.cudaGetLastError()  # the query's error is not the program's
        return "pageable"  # an address CUDA never saw (CUDA before 11 answers so)
    kind = int(attributes.type)
    types = runtime.cudaMemoryType
    if kind in (int(types.cudaMemoryTypeDevice), int(types.cudaMemoryTypeManaged)):
        return "device"
    return "pinned" if kind == int(types.cudaMemoryTypeHost) else "pageable"


def ask_driver(address: int, nbytes: int) -> torch.device:
    """The device of memory another allocator made (``cudaMalloc`` through cuda-bindings,
    ``cudaHostRegister``, plain host memory), as the driver says (:func:`memory_type`)."""
    kind = memory_type(address)
    if kind is None:
        raise Unplaced(f"address {address:#x} ({nbytes} bytes) is in no allocation PyTorch knows, and without "
                       f"cuda-bindings kvzero cannot ask the driver whether it is device or host memory: install "
                       f"cuda-bindings (pip install cuda-bindings), or the op's extension")
    if kind == "device":
        from cuda.bindings import runtime

        _, attributes = runtime.cudaPointerGetAttributes(address)
        return torch.device("cuda", int(attributes.device))
    return CPU


def copy_bytes(copies: Copies, placement: Placement) -> None:
    """Make ``copies`` in order, each as a torch copy on the current stream (see the module
    docstring). Every address is placed before any byte moves."""
    sides: list[tuple[torch.device, torch.device, int, int, int]] = []
    for src, dst, nbytes in copies:
        if nbytes > 0:
            sides.append((placement.device_of(int(src), int(nbytes)), placement.device_of(int(dst), int(nbytes)),
                          int(src), int(dst), int(nbytes)))
    with torch._C.DisableTorchFunction(), no_dispatch():
        for src_device, dst_device, src, dst, nbytes in sides:
            byte_view(dst, nbytes, dst_device).copy_(byte_view(src, nbytes, src_device), non_blocking=True)


__all__ = ["Placement", "Unplaced", "allocator_holding", "allocator_segments", "ask_driver", "byte_view", "copy_bytes", "cuda_running",
           "memory_type"]
