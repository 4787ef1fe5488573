"""The simulated GPU, as ``torch.cuda`` and ``torch.accelerator`` describe it to a zeroer.

On the simulator there is no GPU, yet engine code asks about one before it touches a tensor:
``torch.cuda.is_available()``, ``torch.cuda.current_device()``, ``torch.cuda.get_device_properties(i)``
(vLLM's runner sizes work by ``.multi_processor_count``), ``torch.accelerator.current_accelerator()``.
While an intercepted zeroer runs on the simulator these answer for one device, ``cuda:0``, shaped
like a Hopper GPU (compute capability 9.0, 132 multiprocessors): the simulator's kernels run under
Triton's interpreter, so no number here changes what a kernel does, only what the zeroer's code
reads; ``torch.Generator(device="cuda")`` is a CPU generator that says ``cuda:0``
(:class:`SimCudaGenerator`). Streams, events and synchronisation are :mod:`kvdevice.intercept.cuda_api`'s.

Example (inside an intercepted call on the simulator)::

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    props.name, props.major, props.multi_processor_count       # ('simulated GPU (kvzero-fuzz)', 9, 132)
"""

from __future__ import annotations

from typing import Any

import torch

from kvdevice.intercept.errors import unroutable
from kvdevice.origin import stand_in
from racecheck.devices import names_cuda

NAME = "simulated GPU (kvzero-fuzz)"
CAPABILITY = (9, 0)


@stand_in
class SimDeviceProperties:
    """``torch.cuda.get_device_properties(i)`` of the simulated GPU (an H100-like shape)."""

    name = NAME
    major, minor = CAPABILITY
    multi_processor_count = 132
    total_memory = 80 * 2**30
    is_integrated = False
    is_multi_gpu_board = False
    max_threads_per_multi_processor = 2048
    max_threads_per_block = 1024
    warp_size = 32
    regs_per_multiprocessor = 65536
    shared_memory_per_block = 48 * 2**10
    shared_memory_per_block_optin = 227 * 2**10
    shared_memory_per_multiprocessor = 228 * 2**10
    L2_cache_size = 50 * 2**20
    gcnArchName = "NVIDIA H100 80GB HBM3"
    uuid = "GPU-00000000-0000-0000-0000-000000000000"

    def __repr__(self) -> str:
        return (f"_CudaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
                f"total_memory={self.total_memory // 2**20}MB, multi_processor_count={self.multi_processor_count})")


_PROPERTIES = SimDeviceProperties()


def _one_device(device: Any = None) -> int:
    """The index ``device`` names; the simulator has one device, 0 (None: the current one)."""
    if device is None:
        return 0
    index = device if isinstance(device, int) else torch.device(device).index
    if index not in (None, 0):
        raise unroutable(f"CUDA device {index}", "the simulator has one device, cuda:0",
                         "use the device of the KV cache the factory gets (cache.device)")
    return 0


@stand_in
class _DeviceContext:
    """``torch.cuda.device(i)`` / ``torch.accelerator.device_index(i)``: there is one device, 0."""

    def __init__(self, device: Any = None) -> None:
        _one_device(device)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class _GeneratorType(type(torch._C.Generator)):  # type: ignore[misc] - torch's own metaclass, extended
    """``isinstance(g, torch.Generator)`` while the stand-in is ``torch.Generator``: torch's CPU
    generators are generators still (torch's own code and the code under test ask)."""

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, torch._C.Generator)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, torch._C.Generator)


@stand_in
class SimCudaGenerator(torch._C.Generator, metaclass=_GeneratorType):
    """``torch.Generator(device="cuda")`` on the simulator, where a CPU build of torch has no CUDA
    generator to make: a CPU generator (the simulated device draws on the CPU) that says it is
    ``cuda:0``. Engines' tests seed one and pass it to ``torch.randn(..., device="cuda",
    generator=g)``: the same seed gives the same draws (not CUDA's values: a different algorithm).
    Any other device gets torch's own generator."""

    def __new__(cls, device: Any = "cpu") -> Any:
        if not names_cuda(device):
            return torch._C.Generator(device)
        _one_device(device)
        return super().__new__(cls, device="cpu")

    def __init__(self, device: Any = "cpu") -> None:
        super().__init__()  # torch's __init__ would parse the device again

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0)


def _query(answer: Any) -> Any:
    """A device query (``get_device_name(device=None)``, ...) that answers ``answer`` for the one device."""
    def query(device: Any = None) -> Any:
        _one_device(device)
        return answer
    return query


def _sleep(cycles: int) -> None:
    raise unroutable("torch.cuda._sleep", "the harness cannot order or schedule it",
                     "on the simulator a stream is held back by the fuzzer's delay steps")


CUDA_DEVICE: dict[str, Any] = {
    "is_available": lambda: True,
    "is_initialized": lambda: True,
    "init": lambda: None,
    "device_count": lambda: 1,
    "current_device": lambda: 0,
    "set_device": _one_device,
    "device": _DeviceContext,
    "get_device_name": _query(NAME),
    "get_device_capability": _query(CAPABILITY),
    "get_device_properties": _query(_PROPERTIES),
    "_sleep": _sleep,
}

TORCH: dict[str, Any] = {"Generator": SimCudaGenerator}

ACCELERATOR: dict[str, Any] = {
    "is_available": lambda: True,
    "current_accelerator": lambda check_available=False: torch.device("cuda"),
    "device_count": lambda: 1,
    "current_device_index": lambda: 0,
    "current_device_idx": lambda: 0,
    "set_device_index": _one_device,
    "set_device_idx": _one_device,
    "device_index": _DeviceContext,
}
