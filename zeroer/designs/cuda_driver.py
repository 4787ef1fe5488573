"""The CUDA driver calls the graph ring makes, bound with ctypes.

Why not torch: on an H200 host (docs/performance.md) ``CUDAGraph.replay()`` costs about 6 us and
``Event.record()`` about 10 us, 7 of them spent building a Python object for the current stream;
the driver's calls on the raw handles torch already holds, through ctypes, measured 3.6 to 6.2 us
(``cuGraphLaunch``, 1 to 256 ids) and 1.1 to 1.3 us (``cuEventRecord``) on the same host
(docs/performance.md, "Where graph_ring's time goes"). The
handles are interchangeable: a ``cudaStream_t`` is a ``CUstream``, a ``cudaEvent_t`` a
``CUevent``, a ``cudaGraphExec_t`` a ``CUgraphExec``.

The calls run in the calling thread's current CUDA context. torch makes its primary context
current on every thread that has used CUDA through it; on a thread that has not, the driver
answers CUDA_ERROR_INVALID_CONTEXT, and :class:`Driver` then makes the device's primary context
(the one torch uses) current and retries once.

Example (needs a GPU)::

    drv = load_driver()
    if drv is not None:
        drv.call("cuGraphLaunch", 0, graph.raw_cuda_graph_exec(), torch._C._cuda_getCurrentRawStream(0))
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_CONTEXT = 201
CUDA_ERROR_NOT_READY = 600


class DriverError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the CUresult."""


class Driver:
    """``cuGraphLaunch``, ``cuEventRecord``, ``cuEventQuery`` and ``cuMemcpyHtoDAsync`` on raw
    integer handles and addresses.

    ``fn[name]`` is the bare ctypes function, returning the CUresult: the hot path calls it and
    hands a non-zero status to :meth:`recover`. The methods check for themselves.
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        handle = ctypes.c_void_p
        self.fn: dict[str, Callable[..., int]] = {
            "cuGraphLaunch": self._bind("cuGraphLaunch", (handle, handle)),
            "cuEventRecord": self._bind("cuEventRecord", (handle, handle)),
            "cuEventQuery": self._bind("cuEventQuery", (handle,)),
            "cuMemcpyHtoDAsync": self._bind("cuMemcpyHtoDAsync_v2",
                                            (ctypes.c_uint64, handle, ctypes.c_size_t, handle)),
        }
        self._device_get = self._bind("cuDeviceGet", (ctypes.POINTER(ctypes.c_int), ctypes.c_int))
        self._retain = self._bind("cuDevicePrimaryCtxRetain", (ctypes.POINTER(handle), ctypes.c_int))
        self._set_current = self._bind("cuCtxSetCurrent", (handle,))
        self._error_name = self._bind("cuGetErrorName", (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)))

    def _bind(self, name: str, argtypes: tuple) -> Callable[..., int]:
        fn = getattr(self._lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
        return fn

    def recover(self, name: str, status: int, device: int, *args: int) -> int:
        """After ``fn[name](*args)`` answered ``status``: if the thread had no current context,
        make GPU ``device``'s primary context current and call once more. Returns the final
        status when it is a success (or, for cuEventQuery, not-ready); raises otherwise."""
        if status == CUDA_ERROR_INVALID_CONTEXT:
            self._make_current(device)
            status = self.fn[name](*args)
        if status == CUDA_SUCCESS or (name == "cuEventQuery" and status == CUDA_ERROR_NOT_READY):
            return status
        raise DriverError(f"{name} failed: {self.error_name(status)}")

    def call(self, name: str, device: int, *args: int) -> None:
        """``fn[name](*args)``, raising :class:`DriverError` on failure."""
        status = self.fn[name](*args)
        if status != CUDA_SUCCESS:
            self.recover(name, status, device, *args)

    def event_done(self, event: int, device: int) -> bool:
        """Whether all work the event last recorded has completed (``cuEventQuery``)."""
        status = self.fn["cuEventQuery"](event)
        if status not in (CUDA_SUCCESS, CUDA_ERROR_NOT_READY):
            status = self.recover("cuEventQuery", status, device, event)
        return status == CUDA_SUCCESS

    def _make_current(self, device: int) -> None:
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        self._check("cuDeviceGet", self._device_get(ctypes.byref(dev), device), device)
        self._check("cuDevicePrimaryCtxRetain", self._retain(ctypes.byref(ctx), dev), device)
        self._check("cuCtxSetCurrent", self._set_current(ctx), device)

    def _check(self, name: str, status: int, device: int) -> None:
        if status != CUDA_SUCCESS:
            raise DriverError(f"{name} failed while making GPU {device}'s primary context current: "
                              f"{self.error_name(status)}")

    def error_name(self, status: int) -> str:
        name = ctypes.c_char_p()
        if self._error_name(status, ctypes.byref(name)) == CUDA_SUCCESS and name.value:
            return f"{name.value.decode()} ({status})"
        return f"CUresult {status}"


@functools.cache
def load_driver() -> Driver | None:
    """The process's CUDA driver library, or None where there is none (a CPU-only machine)."""
    try:
        return Driver(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError):
        return None
