"""``torch.cuda.cudart()`` and ``torch.cuda._sleep`` for a program on the simulator.

A CPU-only torch has no CUDA runtime bindings (``torch.cuda.cudart()`` fails there), yet engines
register their host KV pools with ``torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)`` (SGLang's
HiCache). On the simulator that call makes the range pinned memory of the program (outside the
caching allocator, so nothing protects it from reuse under a pending copy), exactly what the GPU
observer makes of it. ``torch.cuda._sleep(cycles)`` holds a stream on a GPU; on the simulator a
queued op already runs only when the host synchronises, as late as any sleep could make it, so it
queues nothing. The rest of what engines and their tests call on ``torch.cuda`` besides streams and
events answers as a GPU with nothing to report would: seeding (the simulated device draws from the
CPU generator), memory statistics, NVTX marks; a timing event's ``elapsed_time`` reads 0.0.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from kvdevice.intercept.errors import unroutable
from kvdevice.origin import stand_in

class CudaError(int):
    """What torch's ``cudart()`` calls return: its pybind11 enum ``cudaError`` (``torch._C._cudart``),
    which engines read as ``.value`` (vLLM's offload handler), ``int(...)``, ``== 0`` or through
    ``torch.cuda.check_error``. An ``int`` subclass with the enum's ``value``, ``name`` and repr."""

    @property
    def value(self) -> int:
        return int(self)

    @property
    def name(self) -> str:
        return "success" if self == 0 else "???"

    def __repr__(self) -> str:
        return f"<cudaError.{self.name}: {int(self)}>"

    def __str__(self) -> str:
        return f"cudaError.{self.name}"


class _CudaErrorEnum:
    """``torch.cuda.cudart().cudaError``: the enum torch binds, of which only ``success`` is named."""

    success = CudaError(0)

    def __call__(self, value: int) -> CudaError:
        return CudaError(int(value))


CUDA_SUCCESS = CudaError(0)


@stand_in
class CudaRuntimeLibrary:
    """What ``torch.cuda.cudart()`` returns on the simulator: the calls engines make on it."""

    cudaError = _CudaErrorEnum()  # noqa: N815 - CUDA's name

    def __init__(self, session: Any) -> None:
        self._session = session

    def cudaGetErrorString(self, error: int) -> str:  # noqa: N802
        return "no error" if int(error) == 0 else f"CUDA error {int(error)}"

    def cudaHostRegister(self, address: int, nbytes: int, flags: int = 0) -> CudaError:  # noqa: N802 - CUDA's name
        session = self._session
        with session.lock:
            session.boundary("cudaHostRegister")
            session.host.register_range(int(address), int(nbytes), "registered with cudaHostRegister",
                                        site=session.watch.last_site)
        return CUDA_SUCCESS

    def cudaHostUnregister(self, address: int) -> CudaError:  # noqa: N802
        session = self._session
        with session.lock:
            session.boundary("cudaHostUnregister")
            session.host.unregister_range(int(address))
        return CUDA_SUCCESS

    def cudaMemGetInfo(self, device: int = 0) -> tuple[int, int]:  # noqa: N802
        total = 80 * 2**30
        return total, total

    def cudaProfilerStart(self) -> CudaError:  # noqa: N802
        return CUDA_SUCCESS

    def cudaProfilerStop(self) -> CudaError:  # noqa: N802
        return CUDA_SUCCESS

    def __getattr__(self, name: str) -> Any:
        raise unroutable(f"torch.cuda.cudart().{name}", "the simulator has no CUDA runtime to call",
                         "run the program on a GPU (--backend cuda)")


def device_api(session: Any) -> dict[str, Any]:
    """The ``torch.cuda`` entries a program session adds on the simulator."""
    library = CudaRuntimeLibrary(session)

    def cudart() -> CudaRuntimeLibrary:
        return library

    def sleep(cycles: int) -> None:
        session.boundary("torch.cuda._sleep")

    def check_error(result: int) -> None:
        """``torch.cuda.check_error(cudart().cudaHostRegister(...))``: as torch's, an enum or an int."""
        if int(result) != CUDA_SUCCESS:
            raise RuntimeError(library.cudaGetErrorString(result))

    def seed(value: int) -> None:
        # The simulated device draws from the CPU generator, so seeding it seeds that one (not through
        # torch.manual_seed, which seeds every device: this one again).
        torch.default_generator.manual_seed(int(value))

    def nothing(*args: Any, **kwargs: Any) -> None:
        return None

    return {"cudart": cudart, "_sleep": sleep, "check_error": check_error,
            "manual_seed": seed, "manual_seed_all": seed, "seed": nothing, "seed_all": nothing,
            "initial_seed": torch.initial_seed, "get_rng_state": lambda device="cuda": torch.get_rng_state(),
            "set_rng_state": lambda state, device="cuda": torch.set_rng_state(state),
            "get_rng_state_all": lambda: [torch.get_rng_state()],
            "set_rng_state_all": lambda states: torch.set_rng_state(states[0]),
            "memory_reserved": lambda device=None: 0, "max_memory_reserved": lambda device=None: 0,
            "memory_stats": lambda device=None: {}, "set_per_process_memory_fraction": nothing,
            **dict.fromkeys(("reset_peak_memory_stats", "reset_max_memory_allocated",
                             "reset_max_memory_cached", "reset_accumulated_memory_stats"), nothing)}


def nvtx_api() -> dict[str, Any]:
    """``torch.cuda.nvtx`` on the simulator: profiler marks, which change nothing the sanitizer sees."""
    def mark(*args: Any, **kwargs: Any) -> int:
        return 0

    def nothing_marked(*args: Any, **kwargs: Any) -> contextlib.nullcontext:
        """``with torch.cuda.nvtx.range(...)``: nothing to mark on the simulator."""
        return contextlib.nullcontext()

    return {"range_push": mark, "range_pop": mark, "mark": mark, "range_start": mark, "range_end": mark,
            "range": nothing_marked}
