"""A pytest plugin: no state crosses tests.

The tools keep process-wide state while they run: kvzero's CUDA harness runtimes announce themselves
in :mod:`racecheck.schedules` (a sanitizer started later in the process steps aside for them), thread
watches make the patched threading, queue and time primitives act (:mod:`racecheck.thread_hooks`),
the sanitizer's observers patch torch and Triton functions, routers and stand-in extension modules
take modelled calls (:mod:`racecheck.effects`), torch modes sit on the calling thread's stacks. A
test that leaves one open (it failed before its ``close()``, or never called it) changes every later
test of its process: on a GPU, nine observer tests later in one xdist worker saw an extra line
``kvz-sanitize cannot follow kvzero's CUDA harness runtime ...``, far from the test that caused it.

After each test, its fixtures torn down, :func:`no_state_crosses_tests` compares that state with
what was open when the test began (what a module or session fixture holds, or ``--kvz-sanitize``'s
observer, is not the test's). Whatever is new is closed or undone there, and the test fails at
teardown naming it, so the next test starts clean and the report points at the test that leaked.

It costs about a quarter of a millisecond a test (a few short lists, the thread list, and the
attributes of the dozen classes and modules the tools patch): under a second for the suite.
Registered by tests/conftest.py (``pytest_plugins``); ``-p no:state_guard`` turns it off.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import queue
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.utils._device

from racecheck import effects, schedules, thread_hooks
from sanitizer.gpu import c_methods

HELPER_JOIN_S = 0.5  # a helper thread whose turns were closed ends within milliseconds; one still parked does not
_MISSING = object()


@dataclass
class OpenState:
    """What was open when a test began; only what is new at its end is the test's."""

    runtimes: list[Any]
    watches: list[Any]
    helpers: list[Any]
    numpy_watches: list[Any]
    observers: list[Any]
    routes: list[Any]  # what holds each route open (effects.OpenRoute.owner)
    copies: list[Any]
    function_modes: int
    dispatch_modes: int
    meta_path: list[Any]
    collector: tuple[int, ...]
    attributes: list[tuple[Any, dict[str, Any]]]


@pytest.fixture(autouse=True)
def no_state_crosses_tests() -> Iterator[None]:
    """Fails a test that leaves a runtime, watch, patch, route or mode open, once it is undone."""
    before = open_state()
    yield
    leaked = undo_leaks(before)
    if leaked:
        names = "\n".join(f"  - {what}" for what in leaked)
        pytest.fail(f"this test left state open for the tests after it (closed now):\n{names}", pytrace=False)


def open_state() -> OpenState:
    """A snapshot of what is open now, in every registry :func:`undo_leaks` checks."""
    function_modes, dispatch_modes = _mode_depths()
    return OpenState(
        runtimes=[runtime for runtime, _ in schedules.live()],
        watches=thread_hooks.watches(),
        helpers=[thread for thread, _ in thread_hooks.followed_threads()],
        numpy_watches=_numpy_watches(),
        observers=_observers(),
        routes=[route.owner for route in effects.open_routes()],
        copies=_driver_copies(),
        function_modes=function_modes,
        dispatch_modes=dispatch_modes,
        meta_path=list(sys.meta_path),
        collector=gc.get_threshold(),
        attributes=_saved_attributes(),
    )


def undo_leaks(before: OpenState) -> list[str]:
    """Close or undo whatever is open now and was not in ``before``; a line for each. Observers go
    first: stopping one undoes its own patches, watches, routes and mode, which then are not named
    again; each later registry is read after the undoing before it."""
    leaked: list[str] = []

    def undo(what: str, how: Callable[[], Any]) -> None:
        leaked.append(what)
        with contextlib.suppress(Exception):  # undo the rest, whatever one undo raises
            how()

    for obs in reversed(_observers()):  # innermost first
        if _new(obs, before.observers):
            undo(f"a sanitizer observer still started ({type(obs).__name__}: stop() it)", obs.stop)
    for runtime, what in schedules.live():
        if _new(runtime, before.runtimes):
            undo(f"{what} still open in racecheck.schedules ({type(runtime).__name__}: close() it)",
                 lambda runtime=runtime: _close_runtime(runtime))
    for thread, watch in _parked_helpers(before):
        undo(f"helper thread {thread.name!r} of the code under test still parked ({type(watch).__name__}: "
             f"its zeroer or offloader was not closed)", lambda thread=thread, watch=watch: _end_helper(thread, watch))
    for watch in thread_hooks.watches():
        if _new(watch, before.watches):
            undo(f"a thread watch still active ({type(watch).__name__}): the patched threading, queue and time "
                 f"primitives still act for it", lambda watch=watch: thread_hooks.deactivate(watch))
    for watch in _numpy_watches():
        if _new(watch, before.numpy_watches):
            undo(f"a numpy-view watch still active ({type(watch).__name__})",
                 lambda watch=watch: sys.modules["sanitizer.numpy_views"].deactivate(watch))
    for route in effects.open_routes():
        if _new(route.owner, before.routes):
            undo(route.what, route.close)
    for copies in _driver_copies():
        if _new(copies, before.copies):
            undo("an intercept session's driver copies still followed (kvdevice.intercept.driver_copies)",
                 lambda copies=copies: copies.__exit__(None, None, None))
    for what, how in _modes(before):
        undo(what, how)
    for finder in sys.meta_path:
        if _new(finder, before.meta_path) and _our_finder(finder):
            undo(f"an import finder left on sys.meta_path ({type(finder).__qualname__})",
                 lambda finder=finder: sys.meta_path.remove(finder))
    for what, how in _attributes(before):
        undo(what, how)
    if gc.get_threshold() != before.collector:
        undo(f"the garbage collector's thresholds changed from {before.collector} to {gc.get_threshold()}",
             lambda: gc.set_threshold(*before.collector))
    return leaked


# Packages whose import finders a test may leave behind: the tools' own (racecheck.effects' stand-in
# modules, kvdevice.intercept.unroutable) and the suite's. A library's finder installed by its own
# import (six's _SixMetaPathImporter, which matplotlib's dateutil brings; seen on the H100 image) is
# the library's for the process's life: taking it away breaks its later imports.
_OUR_PACKAGES = frozenset({"racecheck", "kvdevice", "sanitizer", "fuzz", "zeroer", "repro", "tests", "examples"})


def _our_finder(finder: Any) -> bool:
    module = type(finder).__module__ or ""
    return module.split(".")[0] in _OUR_PACKAGES or module.startswith("test_") or "conftest" in module


def _new(item: Any, before: list[Any]) -> bool:
    """Whether ``item`` was not open when the test began (by identity: what was open is held until
    its end, so no new object can take an old one's place)."""
    return not any(item is kept for kept in before)


# -- the registries ---------------------------------------------------------------------------------
# A tool's module not imported yet has nothing open: the modules below are looked up, never imported.

def _observers() -> list[Any]:
    observer = sys.modules.get("sanitizer.gpu.observer")
    return observer.running_observers() if observer is not None else []


def _numpy_watches() -> list[Any]:
    views = sys.modules.get("sanitizer.numpy_views")
    return views.watches() if views is not None else []


def _driver_copies() -> list[Any]:
    copies = sys.modules.get("kvdevice.intercept.driver_copies")
    return copies.all_active() if copies is not None else []


def _close_runtime(runtime: Any) -> None:
    """Close a runtime a test left open (its gates open on cuda); it leaves the registry whatever
    its close raises (a deadlock it reports, a lost GPU)."""
    try:
        runtime.close()
    finally:
        schedules.ended(runtime)


def _parked_helpers(before: OpenState) -> list[tuple[Any, Any]]:
    """Threads the code under test started under a watch that can end them (the fuzzer's helper
    threads, kvdevice.intercept.helper_threads), still alive: their zeroer or offloader was not closed."""
    parked = []
    for thread, watch in thread_hooks.followed_threads():
        if not _new(thread, before.helpers) or not callable(getattr(watch, "close", None)):
            continue
        thread.join(HELPER_JOIN_S)  # closed just now: its turns let it go, it is on its way out
        if thread.is_alive():
            parked.append((thread, watch))
    return parked


def _end_helper(thread: Any, watch: Any) -> None:
    watch.close()  # its parked threads unwind (racecheck.turns.TurnsClosed)
    thread.join(HELPER_JOIN_S)


def _mode_depths() -> tuple[int, int]:
    """The depths of the calling thread's torch function and dispatch mode stacks."""
    return torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack()


def _modes(before: OpenState) -> list[tuple[str, Callable[[], None]]]:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode

    left = []
    function_modes, dispatch_modes = _mode_depths()
    if function_modes > before.function_modes:
        names = [type(torch._C._get_function_stack_at(i)).__name__ for i in range(before.function_modes, function_modes)]
        left.append((f"torch function modes left on the stack: {', '.join(names)}",
                     lambda: _pop_until(torch._C._len_torch_function_stack, torch._C._pop_torch_function_stack,
                                        before.function_modes)))
    if dispatch_modes > before.dispatch_modes:
        names = [type(mode).__name__ for mode in _get_current_dispatch_mode_stack()[before.dispatch_modes:]]
        left.append((f"torch dispatch modes left on the stack: {', '.join(names)}",
                     lambda: _pop_until(torch._C._len_torch_dispatch_stack, _pop_mode, before.dispatch_modes)))
    return left


def _pop_until(depth: Callable[[], int], pop: Callable[[], Any], keep: int) -> None:
    while depth() > keep:
        pop()


# -- patched attributes -----------------------------------------------------------------------------
# The tools patch functions of these classes and modules (thread_hooks' permanent patches of
# threading, queue.Queue and time act only under a watch, checked above). Of the torch module only
# the names a tool patches are compared: torch itself rebinds others as it loads parts of itself
# (torch._dynamo wraps torch.manual_seed).
TORCH_NAMES = ("Stream", "Event", "tensor", "as_tensor", "asarray", "Generator")


def _saved_attributes() -> list[tuple[Any, dict[str, Any]]]:
    saved = [(owner, dict(vars(owner))) for owner in _patched_owners()]
    saved.append((torch, {name: vars(torch)[name] for name in TORCH_NAMES if name in vars(torch)}))
    return saved


def _patched_owners() -> list[Any]:
    owners: list[Any] = [torch.Tensor, torch.cuda, torch.cuda.Event, torch.cuda.Stream, torch.cuda.nvtx,
                         torch.accelerator, ctypes.CDLL, queue, torch._C.Event, torch._C.Stream,
                         torch.utils._device.DeviceContext]
    graph = getattr(torch.cuda, "CUDAGraph", None)
    if graph is not None:
        owners.append(graph)
    cudart = getattr(torch._C, "_cudart", None)  # what torch.cuda.cudart() returns, without initialising CUDA
    if cudart is not None:
        owners.append(cudart)
    jit = sys.modules.get("triton.runtime.jit")
    if jit is not None:
        owners.append(jit.JITFunction)
    for name in ("cuda.bindings.driver", "cuda.bindings.runtime", "cuda.cuda", "cuda.cudart"):
        module = sys.modules.get(name)  # the entry points the sanitizer and the intercept patch
        if module is not None:
            owners.append(module)
    return owners


def _attributes(before: OpenState) -> list[tuple[str, Callable[[], None]]]:
    patched = []
    for owner, saved in before.attributes:
        now = vars(owner)
        if owner is torch:
            now = {name: now[name] for name in TORCH_NAMES if name in now}
        if len(now) == len(saved) and all(now.get(name, _MISSING) is value for name, value in saved.items()):
            continue  # the common case: nothing changed
        changed = [name for name, value in saved.items() if now.get(name, _MISSING) is not value and _patchable(value)]
        added = [name for name, value in now.items() if name not in saved and _ours(value)]
        if changed or added:
            where = getattr(owner, "__qualname__", None) or getattr(owner, "__name__", repr(owner))
            patched.append((f"{where}.{{{', '.join(changed + added)}}} still patched",
                            lambda owner=owner, saved=saved, changed=changed, added=added:
                            _restore(owner, saved, changed, added)))
    return patched


def _patchable(value: Any) -> bool:
    """A function or method a tool may have replaced (module flags such as ``torch.cuda._initialized``
    change as torch starts, and are nobody's patch)."""
    return callable(value) or isinstance(value, (property, classmethod, staticmethod))


def _ours(value: Any) -> bool:
    """A stand-in of this project's tools (an attribute added where the original had none)."""
    module = getattr(value, "__module__", None) or ""
    return callable(value) and module.split(".")[0] in ("racecheck", "kvdevice", "zeroer", "sanitizer", "fuzz")


def _restore(owner: Any, saved: dict[str, Any], changed: list[str], added: list[str]) -> None:
    for name in changed:
        try:
            setattr(owner, name, saved[name])
        except TypeError:  # a C type the sanitizer patched through its namespace (torch.Event)
            with contextlib.suppress(TypeError):
                c_methods.replace(owner, name, saved[name])
        except AttributeError:
            pass
    for name in added:
        with contextlib.suppress(AttributeError, TypeError):
            delattr(owner, name)
