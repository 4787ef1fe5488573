"""Triton kernels on CPU tensors: Triton's interpreter, with the kernel's ``@triton.jit`` callees too.

The simulator runs every kernel on CPU memory under Triton's interpreter (CI has no GPU). An
``InterpretedFunction`` built in a process where ``TRITON_INTERPRET`` was unset cannot call other
``@triton.jit`` functions, Triton's own ``tl.zeros`` among them ("Cannot call @triton.jit'd
outside of the scope of a kernel"): those were made as ``JITFunction`` when ``triton.language``
was imported. While :func:`launch_on_cpu` runs a kernel, such a call runs the callee's source
under the interpreter, and the interpreter's language patch covers both ``triton.language`` and
its ``core`` module (which the standard library calls), once for the whole launch.

Example::

    @triton.jit
    def fill(ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(ptr + offs, tl.zeros([BLOCK], dtype=tl.int32), mask=offs < n)

    x = torch.ones(8, dtype=torch.int32)
    launch_on_cpu(fill, (1,), x, 8, BLOCK=8)      # x is all zeros
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import triton.language as tl
from triton.language import core as tl_core
from triton.runtime import interpreter as triton_interpreter
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction


@functools.lru_cache(maxsize=None)
def interpreted(fn: Any) -> InterpretedFunction:
    """The interpreter's form of the Python function ``fn`` (a ``JITFunction``'s ``.fn``), kept."""
    return InterpretedFunction(fn)


def _interpret_call(self: JITFunction, *args: Any, **kwargs: Any) -> Any:
    # The language is patched for the whole launch (nested_calls_interpreted), so the callee runs
    # as rewritten, without patching it again (InterpretedFunction.__call__ would, at several
    # milliseconds a call).
    return interpreted(self.fn).rewrite()(*args, **kwargs)


def _language_modules() -> Any:
    """Never called: its globals name ``tl`` and ``tl_core``, so that patching the interpreter's
    language for it patches both modules a kernel or its callees can reach."""
    return (tl, tl_core)


@contextlib.contextmanager
def nested_calls_interpreted() -> Iterator[None]:
    """Inside, a ``@triton.jit`` function called from an interpreted kernel is interpreted too."""
    call = JITFunction.__call__
    JITFunction.__call__ = _interpret_call  # type: ignore[method-assign]
    # Patched first and restored last: a launch's own patch of its kernel's language nests inside.
    language = triton_interpreter._patch_lang(_language_modules)
    try:
        yield
    finally:
        language.restore()
        JITFunction.__call__ = call  # type: ignore[method-assign]


def launch_on_cpu(kernel: Any, grid: Any, *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)`` on CPU tensors, under the interpreter (see the module docstring).

    ``kernel`` is a ``@triton.jit`` function (or its Python source function); launch options
    such as ``num_warps`` are accepted and ignored, as the interpreter does.
    """
    fn = kernel.fn if isinstance(kernel, JITFunction) else kernel
    with nested_calls_interpreted():
        interpreted(fn)[grid](*args, **kwargs)
