"""CUDA work the harness cannot route, refused with a clear error instead of passing silently.

A zeroer that reaches the GPU around torch (cupy, pycuda, numba.cuda, cuda-python, or the CUDA
libraries through ``ctypes``) issues work the simulator cannot run and the controlled mode
cannot gate or order. While such a zeroer runs under interception on the simulator or in the
controlled mode, importing one of those packages or loading a CUDA library through ``ctypes`` is
an :class:`~zeroer.intercept.errors.InterceptError` naming it and pointing to the free-running
mode, where the zeroer's calls run as they are; so is a zeroer whose module had already loaded
one (checked when it is bound).

Example::

    with unroutable_guard(session):
        import cupy            # InterceptError: importing 'cupy' inside an intercepted zeroer: ...
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.abc
import sys
from typing import Any, Iterator

from zeroer.intercept.errors import unroutable

GPU_PACKAGES = ("cupy", "pycuda", "numba.cuda", "cuda.bindings", "cuda.cuda", "cuda.cudart")
CUDA_LIBRARIES = ("libcuda", "libcudart", "libnvrtc", "nvcuda", "cudart64")


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
    """Refuse GPU packages and CUDA libraries inside (simulator and controlled mode only)."""
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
        yield
    finally:
        ctypes.CDLL.__init__ = original  # type: ignore[method-assign]
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(finder)


def check_no_gpu_packages(spec: str, backend: str) -> None:
    """Before binding on the simulator or in the controlled mode: no other GPU package may be loaded."""
    loaded = loaded_gpu_packages()
    if loaded:
        raise unroutable(
            f"zeroer {spec!r} on the {backend} backend",
            f"this process has imported {', '.join(loaded)}, whose CUDA calls bypass torch and cannot be "
            f"simulated or gated",
        )
