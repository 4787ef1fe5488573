"""Runtimes that order CUDA streams on a schedule of their own, announced to whoever watches.

kvzero's fuzz harness runs a zeroer on CUDA through a runtime that holds its streams behind gate
kernels spinning on flags the host writes (:mod:`racecheck.gate`): an order no torch hook shows.
A sanitizer watching the same process would take that work for unordered and report races the
gates prevent. So such a runtime announces itself here when it starts and when it closes
(:func:`started`, :func:`ended`), and a sanitizer subscribes (:func:`subscribe`) and steps aside
meanwhile; the runtime checks its own work with the same happens-before checker.

Example::

    unsubscribe = subscribe(lambda runtime, what: print("aside for", what), lambda runtime: print("back"))
    started(rt, "kvzero's CUDA harness runtime")    # -> aside for kvzero's CUDA harness runtime
    ended(rt)                                       # -> back
    unsubscribe()
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable
from typing import Any

_SUBSCRIBERS: list[tuple[Callable[[Any, str], None], Callable[[Any], None]]] = []
_LIVE: dict[int, tuple["weakref.ref[Any]", str, Any]] = {}  # id(runtime) -> (ref, what, finalizer)
_LOCK = threading.Lock()


def subscribe(on_start: Callable[[Any, str], None], on_end: Callable[[Any], None]) -> Callable[[], None]:
    """Be told of every such runtime's start and end until the returned function is called; one
    already running is told at once."""
    entry = (on_start, on_end)
    if _LIVE:
        # A runtime dropped without close() stays here until the collector finalises it (runtimes
        # hold reference cycles): collect first, so a new subscriber does not step aside for garbage.
        gc.collect()

    def unsubscribe() -> None:
        with _LOCK:
            if entry in _SUBSCRIBERS:
                _SUBSCRIBERS.remove(entry)

    with _LOCK:
        _SUBSCRIBERS.append(entry)
        live = [(ref(), what) for ref, what, _ in _LIVE.values()]
    try:
        for runtime, what in live:
            if runtime is not None:
                on_start(runtime, what)
    except BaseException:  # the caller gets no unsubscribe to call: nothing stays subscribed
        unsubscribe()
        raise
    return unsubscribe


def started(runtime: Any, what: str) -> None:
    """``runtime`` starts ordering streams its own way (``what`` names it in a note)."""
    key = id(runtime)
    with _LOCK:
        if key in _LIVE:
            return
        finalizer = weakref.finalize(runtime, _end, key, None)
        _LIVE[key] = (weakref.ref(runtime), what, finalizer)
        subscribers = list(_SUBSCRIBERS)
    for on_start, _ in subscribers:
        on_start(runtime, what)


def ended(runtime: Any) -> None:
    """``runtime`` closed: it has synchronised its work."""
    _end(id(runtime), runtime)


def running() -> int:
    """How many such runtimes are running now."""
    return len(_LIVE)


def live() -> list[tuple[Any, str]]:
    """The runtimes running now, each with what it is (``what`` of :func:`started`), oldest first.
    One dropped without closing is here until the garbage collector finalises it."""
    with _LOCK:
        entries = list(_LIVE.values())
    return [(runtime, what) for ref, what, _ in entries if (runtime := ref()) is not None]


def _end(key: int, runtime: Any) -> None:
    """The runtime with ``id`` ``key`` ended: closed, or dropped without closing (``runtime`` None:
    its subscribers count it gone)."""
    with _LOCK:
        entry = _LIVE.pop(key, None)
        subscribers = list(_SUBSCRIBERS)
    if entry is not None:
        entry[2].detach()  # nothing to do where its finalizer is what runs this
        for _, on_end in subscribers:
            on_end(runtime)
