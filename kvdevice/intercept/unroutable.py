"""CUDA work the harness cannot route, refused with a clear error instead of passing silently.

A zeroer that reaches the GPU around torch (cupy, pycuda, numba.cuda, or the CUDA libraries
through ``ctypes``) issues work the simulator cannot run and the controlled mode cannot gate or
order. While such a zeroer runs under interception on the simulator or in the controlled mode,
importing one of those packages or loading a CUDA library through ``ctypes`` is an
:class:`~kvdevice.intercept.errors.InterceptError` naming it and pointing to the free-running mode,
where the zeroer's calls run as they are; so is a zeroer whose module had already loaded one
(checked when it is bound).

NVIDIA's ``cuda-bindings`` (``cuda.bindings``, and cuda-python's older ``cuda.cuda`` and
``cuda.cudart``) is different: torch 2.13 imports ``cuda.bindings.runtime`` when torch itself is
imported, wherever the package is installed, and engines that call the driver import it too
(vLLM's SimpleCPUOffload resolves ``cuMemcpyBatchAsync`` with ``cuGetProcAddress``). Importing it
moves no bytes, so it is allowed. The copies engines make through it are followed
(:mod:`kvdevice.intercept.driver_copies`: ``cuGetProcAddress`` of ``cuMemcpyBatchAsync`` or
``cuMemcpyAsync``, ``cuMemcpyAsync``, ``cudaMemcpyAsync``), and so are those symbols of the CUDA
libraries loaded through ``ctypes``; what is refused, at the call, is every other entry point of
:data:`BINDING_PREFIXES` that queues, orders or moves device work (copies, memsets, launches,
stream and event calls, graphs) or hands back a raw function pointer, named as the code spells it,
and every other symbol of a CUDA library.

Example::

    with unroutable_guard(session):
        import cupy            # InterceptError: importing 'cupy' inside the intercepted code under test: ...
        from cuda.bindings import driver
        driver.cuMemcpyAsync(dst, src, n, stream)   # followed: one queued op of the session
        driver.cuMemsetD8Async(dst, 0, n, stream)   # InterceptError: cuda.bindings.driver.cuMemsetD8Async ...
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any, Iterator

from kvdevice.intercept.driver_copies import FollowedLibrary
from kvdevice.intercept.errors import unroutable

GPU_PACKAGES = ("cupy", "pycuda", "numba.cuda")
CUDA_LIBRARIES = ("libcuda", "libcudart", "libnvrtc", "nvcuda", "cudart64")
#: the modules of NVIDIA's bindings whose byte-moving entry points are refused at the call
BINDING_MODULES = ("cuda.bindings.driver", "cuda.bindings.runtime", "cuda.cuda", "cuda.cudart")
#: entry points that queue, order or move device work, or hand back a raw function pointer
BINDING_PREFIXES = ("cuMemcpy", "cuMemset", "cuLaunch", "cuStream", "cuEvent", "cuGraph", "cuGetProcAddress",
                    "cuMemFree", "cuMemAlloc", "cuMemHostRegister", "cuMemHostUnregister",
                    "cudaMemcpy", "cudaMemset", "cudaLaunch", "cudaStream", "cudaEvent", "cudaGraph",
                    "cudaGetDriverEntryPoint", "cudaFree", "cudaMalloc", "cudaHostRegister", "cudaHostUnregister")


def _is_gpu_package(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in GPU_PACKAGES)


def loaded_gpu_packages() -> list[str]:
    """The GPU packages other than torch and triton already imported in this process."""
    return sorted(name for name in GPU_PACKAGES if name in sys.modules)


def from_torch_or_triton(skip: tuple[str, ...] = ()) -> bool:
    """Whether the code asking (the first frame outside the import machinery, this module and the
    modules ``skip`` names) is torch's or Triton's own, which may load what they need."""
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not (module.startswith(("importlib", "_frozen_importlib", "ctypes")) or module == __name__
                or module in skip):
            return module.split(".")[0] in ("torch", "triton")
        frame = frame.f_back
    return False


class _Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if _is_gpu_package(name) and not from_torch_or_triton():
            raise unroutable(f"importing {name!r} inside the intercepted code under test",
                             "its CUDA calls bypass torch, so the harness can neither simulate nor gate them")
        return None


@contextlib.contextmanager
def unroutable_guard(session: Any) -> Iterator[None]:
    """Refuse GPU packages, CUDA libraries and the bindings' device calls inside (simulator and
    controlled mode only)."""
    if not session.rt.scheduled:  # free-running: nothing is gated, anything may run
        yield
        return
    finder = _Refuse()
    sys.meta_path.insert(0, finder)
    cdll = ctypes.CDLL
    original = (cdll.__init__, cdll.__getattr__, cdll.__getitem__)
    simulated = session.backend == "sim"

    def guarded(self: ctypes.CDLL, name: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(name, str) and any(lib in name for lib in CUDA_LIBRARIES) and not from_torch_or_triton():
            # the driver and runtime copies are followed (kvdevice.intercept.driver_copies); on the
            # simulator there is no library to load
            if not simulated:
                original[0](self, name, *args, **kwargs)
            self._name, self._kvz_followed = name, FollowedLibrary(name, None if simulated else self)
            if simulated:
                self._handle = 0
            return
        original[0](self, name, *args, **kwargs)

    def symbol(self: ctypes.CDLL, name: str) -> Any:
        followed = self.__dict__.get("_kvz_followed")
        if followed is not None and not name.startswith("_"):
            return followed[name]
        return original[1](self, name)

    def item(self: ctypes.CDLL, name: Any) -> Any:
        followed = self.__dict__.get("_kvz_followed")
        if followed is not None and isinstance(name, str):
            return followed[name]
        return original[2](self, name)

    cdll.__init__, cdll.__getattr__, cdll.__getitem__ = guarded, symbol, item  # type: ignore[method-assign]
    try:
        with session.driver, _bindings_refused(session):
            yield
    finally:
        cdll.__init__, cdll.__getattr__, cdll.__getitem__ = original  # type: ignore[method-assign]
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(finder)


def _refusal(module: str, name: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise unroutable(f"{module}.{name}", "a CUDA call made around torch moves or orders device work the harness "
                         "can neither simulate nor gate")
    return call


@functools.lru_cache(maxsize=None)
def _entry_points(module_name: str, module: Any) -> tuple[str, ...]:
    # functions only: the bindings' enums and structs (cudaMemcpyKind, CUmemcpyAttributes) stay as they are
    return tuple(n for n in dir(module) if n.startswith(BINDING_PREFIXES) and not isinstance(getattr(module, n), type))


def binding_entry_points() -> list[tuple[str, Any, str]]:
    """(module name, module, function name) of every entry point of :data:`BINDING_PREFIXES` in the
    binding modules loaded now: what moves or orders device work around torch."""
    return [(module_name, module, name) for module_name in BINDING_MODULES
            if (module := sys.modules.get(module_name)) is not None for name in _entry_points(module_name, module)]


@functools.lru_cache(maxsize=None)
def bindings_installed() -> bool:
    """Whether cuda-bindings can be imported here (asked once: a search of sys.path per op cost the
    fuzzer more than its ops where the package is absent)."""
    try:
        return importlib.util.find_spec("cuda.bindings") is not None
    except (ImportError, ValueError):
        return False


def load_bindings() -> None:
    """Import cuda-bindings' driver and runtime where the package is installed: an engine importing
    them inside its call meets them patched (torch 2.11, the GPU image's, does not import them)."""
    for module_name in BINDING_MODULES[:2]:
        if module_name not in sys.modules and bindings_installed():
            with contextlib.suppress(ImportError):
                importlib.import_module(module_name)


@contextlib.contextmanager
def _bindings_refused(session: Any) -> Iterator[None]:
    """Inside, :data:`BINDING_PREFIXES` of every loaded binding module are followed
    (:meth:`~kvdevice.intercept.driver_copies.DriverCopies.binding`) or raise at the call. Entered
    around every op the tool runs: the stand-ins are made once per session and set of modules
    (:meth:`~kvdevice.intercept.driver_copies.DriverCopies.stand_ins`), so an op costs the swaps only."""
    load_bindings()
    modules = [(name, module) for name in BINDING_MODULES if (module := sys.modules.get(name)) is not None]
    saved: list[tuple[dict[str, Any], dict[str, Any]]] = []
    try:
        for module, stand_ins in session.driver.stand_ins(modules, _entry_points, _refusal):
            namespace = vars(module)
            saved.append((namespace, {name: namespace[name] for name in stand_ins}))
            namespace.update(stand_ins)
        yield
    finally:
        for namespace, values in reversed(saved):
            namespace.update(values)


def check_no_gpu_packages(spec: str, backend: str, role: str = "zeroer") -> None:
    """Before binding on the simulator or in the controlled mode: no other GPU package may be loaded."""
    loaded = loaded_gpu_packages()
    if loaded:
        raise unroutable(
            f"{role} {spec!r} on the {backend} backend",
            f"this process has imported {', '.join(loaded)}, whose CUDA calls bypass torch and cannot be "
            f"simulated or gated",
        )
