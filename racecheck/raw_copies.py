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

import bisect
from collections.abc import Iterable, Sequence

import numpy as np
import torch
from torch.utils._mode_utils import no_dispatch

from racecheck.errors import KvzeroError

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
        self._known: list[tuple[int, int, torch.device]] = []
        for tensor in tensors:
            with torch._C.DisableTorchFunction():
                storage = tensor.untyped_storage()
                device = tensor.device
            if device.type in ("cpu", "cuda") and storage.nbytes():
                self._known.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes(), device))
        self._segments: list[tuple[int, int, torch.device]] | None = None
        self._starts: list[int] = []

    def device_of(self, address: int, nbytes: int) -> torch.device:
        """The device whose memory holds ``[address, address + nbytes)`` (``cpu``: host memory)."""
        end = address + nbytes
        for start, stop, device in self._known:
            if start <= address and end <= stop:
                return device
        if not cuda_running():
            return CPU
        found = self._segment(address, end)
        if found is not None:
            return found
        return ask_driver(address, nbytes)

    def _segment(self, address: int, end: int) -> torch.device | None:
        if self._segments is None:
            self._segments = sorted(allocator_segments())
            self._starts = [s for s, _, _ in self._segments]
        i = bisect.bisect_right(self._starts, address) - 1
        if i >= 0 and end <= self._segments[i][1]:
            return self._segments[i][2]
        return None


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


def allocator_block_at(address: int) -> tuple[int, int] | None:
    """[start, end) of the live block of PyTorch's CUDA caching allocator that holds ``address``."""
    for segment in torch.cuda.memory_snapshot():
        start = int(segment["address"])
        for block in segment.get("blocks", ()):
            begin = int(block.get("address", start))
            start = begin + int(block["size"])
            if block.get("state") == "active_allocated" and begin <= address < start:
                return begin, start
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


__all__ = ["Placement", "Unplaced", "allocator_block_at", "allocator_segments", "ask_driver", "byte_view", "copy_bytes", "cuda_running",
           "memory_type"]
