"""The program's CUDA context on the thread where a tool issues the program's driver call.

A driver entry point (``cuMemcpyBatchAsync``, ``cuMemcpyAsync``) acts in the context current on
the calling thread; with none current it answers ``CUDA_ERROR_NOT_INITIALIZED`` (3) or
``CUDA_ERROR_INVALID_CONTEXT``. The program's own call gets the context torch made current on its
thread (any torch call on a stream does ``cudaSetDevice``, which makes the device's primary context
current). A tool's call on the program's behalf may come from another thread (a gate's executor,
the copy thread before torch touched it) or after the tool's own pointer stood in for the real one:
vLLM's SimpleCPUOffload under the fuzzer on CUDA got 3 from its copy thread's
``cuMemcpyBatchAsync`` and reported ``copy thread is not running`` (issue 53). So the tool takes,
at the program's call and on its thread, the context that call would act in (the current one, else
the stream's, else the device's primary context) and makes it current around the real call.

The driver is reached through ``ctypes`` on ``libcuda`` (:class:`LibcudaContexts`); tests put a
stand-in in its place with :func:`use_api` (a context per thread, a driver that refuses without one).

Example::

    ctx = program_context(stream.cuda_stream)      # on the program's thread, at its call
    ...
    with in_context(ctx):                          # on whichever thread issues the call
        err = real_cuMemcpyBatchAsync(...)
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator
from typing import Any, Protocol

import torch

# Taken before any tool patches ``ctypes.CDLL`` (kvdevice.intercept.unroutable): the tool's own
# library is never the program's followed one.
_CDLL_INIT = ctypes.CDLL.__init__
LIBCUDA = "libcuda.so.1"


class ContextApi(Protocol):
    """The few driver calls that say and set a thread's context (0: none)."""

    def current(self) -> int: ...

    def of_stream(self, stream: int) -> int: ...

    def primary(self, device: int) -> int: ...

    def push(self, ctx: int) -> None: ...

    def pop(self) -> None: ...


class LibcudaContexts:
    """:class:`ContextApi` through ``ctypes`` on ``libcuda``."""

    def __init__(self, name: str = LIBCUDA) -> None:
        lib = ctypes.CDLL.__new__(ctypes.CDLL)
        _CDLL_INIT(lib, name)
        self._lib = lib
        self._primary: dict[int, int] = {}  # device -> its primary context, retained once for the process
        self._lock = threading.Lock()
        self._fns: dict[str, object] = {}

    def _fn(self, name: str) -> Any:
        """The entry point ``name``, made from the library's own function type: never through
        ``CDLL.__getattr__``, which a tool watching the program patches (the sanitizer on the
        H100 reported this module's own ``cuStreamGetCtx`` as the program's unfollowed call)."""
        fn = self._fns.get(name)
        if fn is None:
            fn = self._fns[name] = self._lib._FuncPtr((name, self._lib))
        return fn

    def _ctx_out(self, fn: str, *args: object) -> int:
        out = ctypes.c_void_p(0)
        err = self._fn(fn)(*args, ctypes.byref(out))
        return int(out.value or 0) if err == 0 else 0

    def current(self) -> int:
        return self._ctx_out("cuCtxGetCurrent")

    def of_stream(self, stream: int) -> int:
        return self._ctx_out("cuStreamGetCtx", ctypes.c_void_p(stream)) if stream else 0

    def primary(self, device: int) -> int:
        with self._lock:
            ctx = self._primary.get(device)
            if ctx is None:
                handle = ctypes.c_int(0)
                if self._fn("cuDeviceGet")(ctypes.byref(handle), ctypes.c_int(device)) != 0:
                    return 0
                ctx = self._primary[device] = self._ctx_out("cuDevicePrimaryCtxRetain", handle)
            return ctx

    def push(self, ctx: int) -> None:
        self._fn("cuCtxPushCurrent_v2")(ctypes.c_void_p(ctx))

    def pop(self) -> None:
        self._fn("cuCtxPopCurrent_v2")(ctypes.byref(ctypes.c_void_p(0)))


_API: list[ContextApi | None] = []  # made on first use; empty until then


def api() -> ContextApi | None:
    """The driver's context calls, or None where there is no driver (the simulator's machine)."""
    if not _API:
        try:
            _API.append(LibcudaContexts())
        except OSError:
            _API.append(None)
    return _API[-1]


@contextlib.contextmanager
def use_api(stand_in: ContextApi | None) -> Iterator[None]:
    """Inside, ``stand_in`` answers for the driver (tests: a context per thread, on a CPU)."""
    _API.append(stand_in)
    try:
        yield
    finally:
        _API.pop()


def program_context(stream: int) -> int:
    """On the program's thread, at its call on ``stream`` (a raw handle, 0 the default stream): the
    context the call acts in. The thread's current one; with none (a thread torch has not touched),
    the stream's, else the primary context of torch's current device, as CUDA's runtime would make
    current. 0 where there is no driver."""
    driver = api()
    if driver is None:
        return 0
    ctx = driver.current() or driver.of_stream(stream)
    if not ctx:
        device = torch.cuda.current_device() if torch.cuda.is_available() else 0
        ctx = driver.primary(device)
    return ctx


@contextlib.contextmanager
def in_context(ctx: int) -> Iterator[None]:
    """Inside, ``ctx`` is current on the calling thread (pushed where another or none is, then popped)."""
    driver = api()
    if driver is None or not ctx or driver.current() == ctx:
        yield
        return
    driver.push(ctx)
    try:
        yield
    finally:
        driver.pop()
