"""CUDA work the harness cannot route, refused with a clear error instead of passing silently.

A zeroer that reaches the GPU around torch (cupy, pycuda, numba.cuda, or the CUDA libraries
through ``ctypes``) issues work the simulator cannot run and the controlled mode cannot gate or
order. While such a zeroer runs under interception on the simulator or in the controlled mode,
importing one of those packages or loading a CUDA library through ``ctypes`` is an
:class:`~zeroer.intercept.errors.InterceptError` naming it and pointing to the free-running mode,
where the zeroer's calls run as they are; so is a zeroer whose module had already loaded one
(checked when it is bound).

NVIDIA's ``cuda-bindings`` (``cuda.bindings``, and cuda-python's older ``cuda.cuda`` and
``cuda.cudart``) is different: torch 2.13 imports ``cuda.bindings.runtime`` when torch itself is
imported, wherever the package is installed, and engines that call the driver import it too
(vLLM's SimpleCPUOffload resolves ``cuMemcpyBatchAsync`` with ``cuGetProcAddress``). Importing it
moves no bytes, so it is allowed; what is refused, at the call, is each entry point of
:data:`BINDING_PREFIXES` that queues, orders or moves device work (copies, memsets, launches,
stream and event calls, graphs) or hands back a raw function pointer, named as the code spells it.

Example::

    with unroutable_guard(session):
        import cupy            # InterceptError: importing 'cupy' inside an intercepted zeroer: ...
        from cuda.bindings import driver
        driver.cuMemcpyAsync(dst, src, n, stream)   # InterceptError: cuda.bindings.driver.cuMemcpyAsync ...
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.abc
import sys
from typing import Any, Iterator

from zeroer.intercept.errors import unroutable

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


def _from_torch_or_triton() -> bool:
    """Whether the code asking (the first frame outside the import machinery and this module) is
    torch's or Triton's own, which may load what they need."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not (module.startswith(("importlib", "_frozen_importlib", "ctypes")) or module == __name__):
            return module.split(".")[0] in ("torch", "triton")
        frame = frame.f_back
    return False


class _Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if _is_gpu_package(name) and not _from_torch_or_triton():
            raise unroutable(f"importing {name!r} inside an intercepted zeroer",
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
    original = ctypes.CDLL.__init__

    def guarded(self: ctypes.CDLL, name: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(name, str) and any(lib in name for lib in CUDA_LIBRARIES) and not _from_torch_or_triton():
            raise unroutable(f"ctypes.CDLL({name!r}) inside an intercepted zeroer",
                             "raw CUDA calls (cudaMemcpyAsync, kernel launches) bypass torch, so the harness "
                             "can neither simulate nor gate them")
        original(self, name, *args, **kwargs)

    ctypes.CDLL.__init__ = guarded  # type: ignore[method-assign]
    try:
        with _bindings_refused():
            yield
    finally:
        ctypes.CDLL.__init__ = original  # type: ignore[method-assign]
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(finder)


def _refusal(module: str, name: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise unroutable(f"{module}.{name}", "a CUDA call made around torch moves or orders device work the harness "
                         "can neither simulate nor gate")
    return call


@functools.lru_cache(maxsize=None)
def _entry_points(module_name: str, module: Any) -> tuple[str, ...]:
    return tuple(n for n in dir(module) if n.startswith(BINDING_PREFIXES))


@contextlib.contextmanager
def _bindings_refused() -> Iterator[None]:
    """Inside, :data:`BINDING_PREFIXES` of every loaded binding module raise at the call."""
    saved: list[tuple[Any, str, Any]] = []
    try:
        for module_name in BINDING_MODULES:
            module = sys.modules.get(module_name)
            if module is None:
                continue
            for name in _entry_points(module_name, module):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, _refusal(module_name, name))
        yield
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)


def check_no_gpu_packages(spec: str, backend: str) -> None:
    """Before binding on the simulator or in the controlled mode: no other GPU package may be loaded."""
    loaded = loaded_gpu_packages()
    if loaded:
        raise unroutable(
            f"zeroer {spec!r} on the {backend} backend",
            f"this process has imported {', '.join(loaded)}, whose CUDA calls bypass torch and cannot be "
            f"simulated or gated",
        )
