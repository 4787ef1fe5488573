"""The simulator's CUDA tensor: reports ``cuda:0``, holds CPU memory, defers its work to a stream.

A :class:`SimCudaTensor` is a wrapper tensor (``torch.Tensor._make_wrapper_subclass``, the
mechanism torch's own FakeTensor uses) over a CPU tensor, ``inner``, whose bytes belong to a block
of :class:`~kvdevice.intercept.sim_memory.SimDeviceMemory`. Every aten op on one reaches
``__torch_dispatch__``, which hands it to the session's router (:mod:`kvdevice.intercept.sim_ops`):
views are made at once, everything that reads or writes device memory is queued on the
simulated current stream and runs when the stream reaches it.

On a CPU-only build of torch, the Python indexing code (``x[1:3]``, ``x[idx] = 0``) asks for a CUDA
device guard that such a build does not have; the session then indexes a *cloaked* twin
(:func:`cloak`), the same wrapper reporting ``cpu``, whose ops reach the same router.

Read on the host by the zeroer's code (``repr``, ``f"{t}"``, ``.tolist()``), its values are read
after the current stream and printed as CUDA prints them (:mod:`kvdevice.intercept.host_reads`);
printed by the harness, between the zeroer's calls, it describes itself and runs nothing.

Example (inside an intercepted zeroer call on the simulator)::

    ids = torch.empty(8, dtype=torch.int64, device="cuda")    # a SimCudaTensor
    ids.is_cuda, ids.device                                  # (True, device(type='cuda', index=0))
    ids[:3].copy_(pinned[:3], non_blocking=True)             # queued on the current stream
"""

from __future__ import annotations

from typing import Any

import torch

from kvdevice.intercept.errors import InterceptError
from kvdevice.intercept.host_reads import cuda_format, cuda_repr
from kvdevice.intercept.sim_memory import SIM_DEVICE, Allocation


class SimCudaTensor(torch.Tensor):
    """A simulated CUDA tensor (see the module docstring)."""

    _inner: torch.Tensor
    _alloc: Allocation
    _session: Any

    @staticmethod
    def __new__(cls, inner: torch.Tensor, alloc: Allocation, session: Any,
                device: torch.device = SIM_DEVICE) -> "SimCudaTensor":
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls, inner.size(), strides=inner.stride(), storage_offset=inner.storage_offset(),
            dtype=inner.dtype, device=device, requires_grad=False,
        )
        wrapper._inner = inner
        wrapper._alloc = alloc
        wrapper._session = session
        return wrapper

    # Torch functions reach the session's TorchFunctionMode, not a per-tensor override.
    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        session = _session_of(args, kwargs or {})
        return session.sim_ops.dispatch(func, args, kwargs or {})

    def data_ptr(self) -> int:  # the simulated memory's real address: tables built from it work
        return self._inner.data_ptr()

    def untyped_storage(self) -> torch.UntypedStorage:
        return self._inner.untyped_storage()

    def __repr__(self) -> str:
        if self._session.in_call:  # the zeroer's repr/str/print: the values, as CUDA prints them
            self._session.boundary("repr(tensor)")
            return cuda_repr(self)
        # The harness looking (a debugger, an assertion): a description that runs no stream.
        return (f"SimCudaTensor(shape={tuple(self.shape)}, dtype={self.dtype}, device='{self.device}', "
                f"block=d{self._alloc.block.id})")

    def __format__(self, spec: str) -> str:
        if self._session.in_call:
            return cuda_format(self, spec)
        return object.__format__(self, spec)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise InterceptError("a simulated CUDA tensor cannot be pickled or deep-copied; keep it in the zeroer")


class _Cloaked(SimCudaTensor):
    """The same tensor reporting ``cpu``, for Python indexing on a CPU-only build (module docstring)."""


def cloak(tensor: SimCudaTensor) -> SimCudaTensor:
    return _Cloaked(tensor._inner, tensor._alloc, tensor._session, torch.device("cpu"))


def uncloak(value: Any) -> Any:
    if isinstance(value, _Cloaked):
        return SimCudaTensor(value._inner, value._alloc, value._session)
    return value


def _session_of(args: tuple, kwargs: dict) -> Any:
    for value in (*args, *kwargs.values()):
        if isinstance(value, SimCudaTensor):
            return value._session
        if isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, SimCudaTensor):
                    return item._session
    raise InterceptError("an op on simulated CUDA tensors found none among its arguments")  # pragma: no cover
