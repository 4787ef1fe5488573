"""Triton kernels on CPU tensors: Triton's interpreter, with the kernel's ``@triton.jit`` callees too.

The simulator runs every kernel on CPU memory under Triton's interpreter (CI has no GPU). An
``InterpretedFunction`` built in a process where ``TRITON_INTERPRET`` was unset cannot call other
``@triton.jit`` functions, Triton's own ``tl.zeros`` among them ("Cannot call @triton.jit'd
outside of the scope of a kernel"): those were made as ``JITFunction`` when ``triton.language``
was imported. While :func:`launch_on_cpu` runs a kernel, such a call runs the callee's source
under the interpreter, and the interpreter's language patch covers both ``triton.language`` and
its ``core`` module (which the standard library calls), once for the whole launch.

Whose a failure under the interpreter is: :func:`raised_by_interpreter` tells the interpreter's own
failure (it could not run the kernel: a gap of the simulator, which a GPU compiles past) from an
error of the kernel's own code.

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
import sys
from typing import Any, Iterator

import numpy as np
import triton.language as tl
from triton.language import core as tl_core
from triton.runtime import interpreter as triton_interpreter
from triton.runtime.errors import InterpreterError
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction


# Frames that raise on behalf of their caller: the first other frame from the raise outwards decides.
_ON_BEHALF = frozenset({"numpy"}) | frozenset(getattr(sys, "stdlib_module_names", ()))


def kernel_error(error: BaseException) -> BaseException:
    """What failed in a kernel: the interpreter re-raises it as ``InterpreterError(repr(e)) from e``."""
    while isinstance(error, InterpreterError) and error.__cause__ is not None:
        error = error.__cause__
    return error


def raised_by_interpreter(error: BaseException) -> bool:
    """Whether Triton's interpreter itself raised ``error``: from the raise outwards, past numpy and
    the standard library, the first frame is the interpreter's module. Then the interpreter could
    not run the kernel, which says nothing of the kernel: an op or an operand the installed Triton's
    interpreter does not take, where a GPU build compiles it (Triton 3.6's loaded loop bound was one,
    until :func:`nested_calls_interpreted` took it in hand). An error of the kernel's own
    code (its frame is the innermost), or of a ``triton.language`` function it misused, is not.
    ``error`` is read under the interpreter's wrapping (:func:`kernel_error`)."""
    frames = []
    tb = kernel_error(error).__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        module = str(frame.f_globals.get("__name__", "") or "")
        if module.split(".")[0] not in _ON_BEHALF:
            return module == triton_interpreter.__name__
    return False


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


def _scalar_index(self: Any) -> int:
    # A loaded scalar's handle holds a one-element array; Triton 3.6 took it as an index with
    # int(array), which NumPy 2 refuses for ndim > 0. Triton 3.9's interpreter squeezes it first.
    return int(np.asarray(self.handle.data).squeeze())


def _index_patched(patch_lang_tensor: Any) -> Any:
    """Triton's own language patch of ``tl.tensor`` (``patch_lang_tensor``), then a loaded scalar's ``__index__``."""
    def patch(tensor: Any, scope: Any) -> None:
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: _scalar_index(self))
    return patch


@contextlib.contextmanager
def nested_calls_interpreted() -> Iterator[None]:
    """Inside, a ``@triton.jit`` function called from an interpreted kernel is interpreted too, and
    a scalar loaded from memory is a loop bound or an index on every Triton we support: Triton 3.6's
    interpreter fails at ``words = tl.load(sizes + job); for start in range(0, words, BLOCK)``
    (``TypeError: only 0-dimensional arrays can be converted to Python scalars`` under NumPy 2),
    which Triton 3.9's interpreter and every GPU build run."""
    call = JITFunction.__call__
    JITFunction.__call__ = _interpret_call  # type: ignore[method-assign]
    # Every language patch made inside (a launch's own too) takes a loaded scalar as an index.
    patch_lang_tensor = triton_interpreter._patch_lang_tensor
    triton_interpreter._patch_lang_tensor = _index_patched(patch_lang_tensor)
    # Patched first and restored last: a launch's own patch of its kernel's language nests inside.
    language = triton_interpreter._patch_lang(_language_modules)
    try:
        yield
    finally:
        language.restore()
        triton_interpreter._patch_lang_tensor = patch_lang_tensor
        JITFunction.__call__ = call  # type: ignore[method-assign]


def launch_on_cpu(kernel: Any, grid: Any, *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)`` on CPU tensors, under the interpreter (see the module docstring).

    ``kernel`` is a ``@triton.jit`` function (or its Python source function); launch options
    such as ``num_warps`` are accepted and ignored, as the interpreter does.
    """
    fn = kernel.fn if isinstance(kernel, JITFunction) else kernel
    with nested_calls_interpreted():
        interpreted(fn)[grid](*args, **kwargs)
