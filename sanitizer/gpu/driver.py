"""Copies the program makes through the CUDA driver and runtime, followed on a GPU as the simulator follows them.

vLLM's SimpleCPUOffload resolves ``cuMemcpyBatchAsync`` with ``cuda.bindings.driver.cuGetProcAddress``
(or through ``ctypes`` on ``libcuda``), wraps the pointer in a ``ctypes.CFUNCTYPE`` and calls it from
a copy thread with numpy arrays of raw addresses. No aten op or trace callback sees those bytes: before
this module the observer said ``no race`` on both racy versions while their values came out wrong
(issue 53). While the observer runs:

* ``cuGetProcAddress`` of ``cuMemcpyBatchAsync`` or ``cuMemcpyAsync`` (bindings, or ``ctypes`` on
  ``libcuda``) hands out the followed pointer of :mod:`kvdevice.intercept.driver_copies`, the same one
  the fuzzer and the simulator hand out, resolved to the real entry point; ``cuMemcpyAsync`` and
  ``cudaMemcpyAsync`` of the bindings, and those symbols of a CUDA library loaded through ``ctypes``,
  are followed too;
* each call, from whichever thread, is one op on the stream its handle names: each (address, size) run
  is placed in device memory (an allocation of the caching allocator) or a pinned or registered host
  region, read or written as a ``copy_`` declares them; a pinned source is snapshotted (force mode
  compares it) and a pinned destination is pending until the host has seen the copy complete; then
  the real entry point runs in the program's context on that thread
  (:mod:`kvdevice.intercept.driver_context`) and its answer is the program's;
* what cannot be followed (a run in memory no allocation holds, another entry point that moves or
  orders device work, the pointer of any other symbol) is one line per call site: the run is
  partial, never ``no race``; the program's call still runs as it would.

Example (the program, under ``python -m sanitizer``)::

    err, ptr, _ = driver.cuGetProcAddress(b"cuMemcpyBatchAsync", 12080, 0)   # the followed pointer
    batch = BATCH(ptr)
    threading.Thread(target=lambda: batch(dsts, srcs, sizes, n, attrs, idx, 1, fail, stream)).start()
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any

import torch

from racecheck.placement import Placed, place
from sanitizer.races import Unfollowed
from sanitizer.sites import Site, also_skip, caller_site
from kvdevice.intercept import driver_copies
from kvdevice.intercept.driver_context import in_context, program_context
from kvdevice.intercept.errors import InterceptError, unroutable
from kvdevice.intercept.unroutable import (BINDING_PREFIXES, CUDA_LIBRARIES, binding_entry_points, from_torch_or_triton,
                                         load_bindings)
from kvdevice.origin import forwarding

# a followed pointer's Python frames stand between the program's call and this module
also_skip(driver_copies.__file__)


class DriverCalls:
    """The observer's follower of the driver copies (:class:`kvdevice.intercept.driver_copies.Follower`)."""

    def __init__(self, obs: Any) -> None:
        self.obs = obs
        self._lines: set[tuple[str, str]] = set()  # (what, site): one line per call site

    # -- lines ----------------------------------------------------------------------------------------
    def unfollowed(self, what: str, site: Site) -> None:
        """One line per call site and kind of call (the run is partial)."""
        key = (what.split(":")[0], str(site))
        with self.obs.lock:
            if key not in self._lines:
                self._lines.add(key)
                self.obs.unfollowed.append(Unfollowed(what, site))

    # -- calls through the followed pointers ------------------------------------------------------------
    def from_c(self, symbol: str, impl: Callable[..., int], args: tuple) -> int:
        if not self.obs._started or self.obs.paused:
            return driver_copies.call_real(symbol, args)
        try:
            return impl(self, *args)
        except InterceptError as error:  # a call the pointer cannot follow, or a pointer of no followed symbol
            self.unfollowed(str(error), caller_site())
            return driver_copies.CUDA_ERROR_INVALID_VALUE

    def copy(self, call: str, runs: list[tuple[int, int, int, str]], handle: int, real: Any) -> Any:
        """Stamp one op on the stream ``handle`` reading and writing ``runs``, then issue ``real`` in the
        program's context; the real call's answer (what the program gets)."""
        obs = self.obs
        site = caller_site()
        issue = real if callable(real) else _real_call(*real)
        ctx = program_context(handle)
        places = self._places(call, runs, site)
        if places is not None:
            with obs.lock:
                obs.boundary(site)
                pinned = any(p.kind == "pinned" for dst, src, _ in places for p in (dst, src))
                held = self._hold(handle) if pinned else None
                stamp = obs.enqueue(call.rpartition(".")[2], handle, site)
                for dst, src, _ in places:
                    self._declare(src, stamp, held, write=False)
                    self._declare(dst, stamp, held, write=True)
        with in_context(ctx):
            result = issue()
        with obs.lock:
            obs.collect()
        return result

    def _places(self, call: str, runs: list[tuple[int, int, int, str]], site: Site) -> list[tuple]:
        """Each run's (destination, source, source order), placed in device or pinned memory; None
        (and one line) where one lies in memory the observer does not know."""
        places = []
        for dst, src, n, order in runs:
            if n <= 0:
                continue
            try:
                places.append((self._place(dst, n, call, "destination"), self._place(src, n, call, "source"), order))
            except InterceptError as error:
                self.unfollowed(f"{error} (the bytes this call moves are not checked)", site)
                return None
        return places

    def _place(self, address: int, size: int, call: str, role: str) -> Placed:
        placed, unplaced = place([(address, address + size)], [self.obs.pinned.regions, self.obs.device])
        if unplaced:
            raise unroutable(f"{call}: {role} {address:#x} ({size} bytes)",
                             "it is not inside one allocation kvz-sanitize knows (device memory, pinned or registered "
                             "host memory): pageable memory, or memory allocated around torch")
        return placed[0]

    def _hold(self, handle: int) -> Any:
        """Force mode: a closed gate on the copy's stream, as a pinned ``copy_`` gets."""
        obs = self.obs
        if obs.forcing is None:
            return None
        with obs.own_work():
            return obs.forcing.hold(torch.cuda.ExternalStream(handle) if handle else torch.cuda.default_stream())

    def _declare(self, place: Placed, stamp: Any, held: Any, *, write: bool) -> None:
        obs = self.obs
        if place.kind == "device":
            obs.device_access_at(place.memory, place.ranges, stamp, write=write)
            return
        view = driver_copies.host_view(place)
        obs.raw_pinned_access(place.memory, stamp, place.ranges, write=write)
        if write:
            obs.queued_write(place.memory, view, stamp, held)
        else:  # the region keeps the snapshot: a raw address has no tensor to outlive
            obs.queued_read(place.memory, view, stamp, held, keep=place.memory)

    # -- the bindings' entry points -------------------------------------------------------------------------
    def binding(self, module: Any, module_name: str, name: str, original: Any) -> Callable[..., Any] | None:
        """The observer's stand-in for ``module_name.name`` of cuda-bindings: followed, or None."""
        calls = self
        if name == "cuGetProcAddress":
            def get_proc_address(symbol: Any, cuda_version: int = 0, flags: int = 0, *rest: Any) -> Any:
                text = symbol.decode() if isinstance(symbol, (bytes, bytearray)) else str(symbol)
                if not calls.obs._started or calls.obs.paused or text not in driver_copies.SYMBOLS \
                        or text.startswith("cuda"):
                    if calls.obs._started and not calls.obs.paused:
                        calls.unfollowed(f"{module_name}.cuGetProcAddress({text!r}) (the calls through the pointer "
                                         f"it returns move bytes no hook sees)", caller_site())
                    return original(symbol, cuda_version, flags, *rest)
                driver_copies.resolve_real(text, lambda: original(symbol, cuda_version, flags, *rest))
                return (module.CUresult.CUDA_SUCCESS, driver_copies.address_of(text),
                        module.CUdriverProcAddressQueryResult.CU_GET_PROC_ADDRESS_SUCCESS)
            return get_proc_address
        if name == "cuMemcpyAsync":
            def cu_memcpy_async(dst: Any, src: Any, n: int, stream: Any) -> Any:
                return calls._bound(f"{module_name}.cuMemcpyAsync", dst, src, n, stream,
                                    lambda: original(dst, src, n, stream))
            return cu_memcpy_async
        if name == "cudaMemcpyAsync":
            def cuda_memcpy_async(dst: Any, src: Any, n: int, kind: Any, stream: Any = 0) -> Any:
                return calls._bound(f"{module_name}.cudaMemcpyAsync", dst, src, n, stream,
                                    lambda: original(dst, src, n, kind, stream))
            return cuda_memcpy_async
        return None

    def _bound(self, call: str, dst: Any, src: Any, n: int, stream: Any, real: Callable[[], Any]) -> Any:
        if not self.obs._started or self.obs.paused:
            return real()
        to_int = driver_copies.raw_int
        return self.copy(call, [(to_int(dst), to_int(src), int(n), "STREAM")], to_int(stream), real)


def _real_call(symbol: str, args: tuple) -> Callable[[], int]:
    real = driver_copies.real_entry(symbol)
    if real is None:
        raise unroutable(f"{symbol} through a pointer kvz-sanitize did not resolve",
                         "resolve it with cuGetProcAddress while the sanitizer runs")
    return lambda: real(*args)


# -- installing (sanitizer.gpu.patches) ------------------------------------------------------------------
def patch_bindings(calls: DriverCalls, patch: Callable[..., None], wrap: Callable[..., Any]) -> None:
    """Every device-work entry point of cuda-bindings: followed (:meth:`DriverCalls.binding`), else
    one line where it was called (its bytes are not checked; the call runs)."""

    def unfollowed(module_name: str, name: str) -> Callable[[Any], Any]:
        what = f"{module_name}.{name} (a copy or launch around torch: the bytes it moves are not checked)"
        return wrap(lambda *args, **kwargs: calls.unfollowed(what, caller_site()))

    load_bindings()
    for module_name, module, name in binding_entry_points():
        followed = calls.binding(module, module_name, name, getattr(module, name))
        patch(module, name, (lambda f: lambda original: f)(followed) if followed is not None
              else unfollowed(module_name, name))


def patch_libraries(calls: DriverCalls, patch: Callable[..., None]) -> None:
    """A CUDA library the program loads through ``ctypes`` (``ctypes.CDLL("libcuda.so.1")``): its
    ``cuGetProcAddress``, ``cuMemcpyBatchAsync``, ``cuMemcpyAsync`` and ``cudaMemcpyAsync`` are the
    followed pointers; any other symbol that moves or orders device work is one line where it was
    looked up (a CDLL keeps the function it found: later calls reach no hook)."""

    def cuda_library(lib: ctypes.CDLL) -> bool:
        name = str(getattr(lib, "_name", "") or "")
        return any(part in name for part in CUDA_LIBRARIES) and not from_torch_or_triton((__name__, "kvdevice.origin"))

    def lookup(original: Any) -> Any:
        @forwarding
        @functools.wraps(original)
        def call(lib: ctypes.CDLL, symbol: Any) -> Any:
            if not isinstance(symbol, str) or symbol.startswith("_") or not calls.obs._started \
                    or calls.obs.paused or not cuda_library(lib):
                return original(lib, symbol)
            if symbol in driver_copies.GET_PROC_TYPES:
                return driver_copies.get_proc_pointer(symbol, lambda: lib._FuncPtr((symbol, lib)))
            if symbol in driver_copies.SYMBOLS:
                driver_copies.resolve_library_symbol(symbol, lambda: lib._FuncPtr((symbol, lib)))
                return driver_copies.pointer(symbol)
            if symbol.startswith(BINDING_PREFIXES):
                calls.unfollowed(f"ctypes {symbol} of {lib._name} (a copy or launch around torch: the bytes it "
                                 f"moves are not checked)", caller_site())
            return original(lib, symbol)

        return call

    patch(ctypes.CDLL, "__getattr__", lookup)
    patch(ctypes.CDLL, "__getitem__", lookup)
