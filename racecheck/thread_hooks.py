"""Every Python thread followed: its CUDA work, and the hand-offs that order it after other threads.

Streams are per thread in CUDA and torch, and engines issue work from helper threads (vLLM's async
output thread copies sampled tokens to the host on its own copy stream; SGLang's cache controller
loads and stores KV from threads of its own). While a sanitizer runs:

* a thread started with ``threading.Thread.start`` (executor workers included) is set up for the
  sanitizer before its target runs (its own dispatch mode: modes are per thread in torch) and is a
  host thread of the checker that knows what its starter knew (:mod:`racecheck.threads`);
* the hand-offs between threads are followed: ``Thread.start``/``join``, ``queue.Queue.put``/``get``,
  ``threading.Event.set``/``wait``, ``threading.Condition.notify``/``wait``,
  ``concurrent.futures.Future.set_result``/``result`` and ``ThreadPoolExecutor.submit``: the
  receiving thread learns what the sending thread had seen complete. A hand-off through something
  else (a lock, ``queue.SimpleQueue``, a flag) is not seen; the checker then says in a note that it
  assumed the order another thread had seen, instead of reporting a race (:mod:`racecheck.hb`).

A thread that was already running when the sanitizer started is not followed (docs/sanitizer.md).

The watch of the running sanitizer (:class:`ThreadWatch`) decides what "set up" means for its
backend; :class:`HandOffs` is the clock bookkeeping both backends share.

Example::

    install()                                # once per process: the patches below
    deactivate = activate(observer)          # the observer implements ThreadWatch
    t = threading.Thread(target=work); t.start(); t.join()   # work() is followed; join orders it
    deactivate()
"""

from __future__ import annotations

import concurrent.futures
import functools
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol


class ThreadWatch(Protocol):
    def thread_starting(self, thread: threading.Thread) -> Any: ...
    def thread_running(self, thread: threading.Thread, token: Any) -> Callable[[], None]: ...
    def thread_setup(self) -> Callable[[], None] | None: ...
    def release(self, obj: Any) -> None: ...
    def acquire(self, obj: Any) -> None: ...


_ACTIVE: list[ThreadWatch] = []
_INSTALLED = False


def activate(watch: ThreadWatch) -> Callable[[], None]:
    """Follow threads for ``watch`` until the returned function is called."""
    install()
    _ACTIVE.append(watch)

    def deactivate() -> None:
        if watch in _ACTIVE:
            _ACTIVE.remove(watch)

    return deactivate


_HOOKED = threading.local()  # per thread: a hook is running (what it calls is not the program's)


def _watch() -> ThreadWatch | None:
    if not _ACTIVE or getattr(_HOOKED, "busy", False):
        return None
    return _ACTIVE[-1]


class _Hooked:
    """While a hook runs, the primitives it uses (an Event inside a dummy thread, say) are not hooked again."""

    def __enter__(self) -> None:
        _HOOKED.busy = True

    def __exit__(self, *exc: object) -> None:
        _HOOKED.busy = False


class HandOffs:
    """What each hand-off object carries: the join of the clocks of the threads that released it."""

    def __init__(self, hb: Any, threads: Any) -> None:
        self.hb = hb
        self.threads = threads
        self._weak: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._strong: dict[int, tuple[Any, tuple[int, ...]]] = {}

    def release(self, obj: Any) -> None:
        snapshot = self.hb.host_snapshot(self.threads.current())
        previous = self._get(obj)
        if previous is not None:
            snapshot = _joined(snapshot, previous)
        try:
            self._weak[obj] = snapshot
        except TypeError:  # not weakly referenceable: kept (with the object) until released again
            self._strong[id(obj)] = (obj, snapshot)

    def acquire(self, obj: Any) -> None:
        snapshot = self._get(obj)
        if snapshot is not None:
            self.hb.host_acquires(self.threads.current(), snapshot)

    def _get(self, obj: Any) -> tuple[int, ...] | None:
        try:
            found = self._weak.get(obj)
        except TypeError:
            found = None
        if found is None:
            entry = self._strong.get(id(obj))
            found = entry[1] if entry is not None and entry[0] is obj else None
        return found


def _joined(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """The element-wise maximum of two clocks (the shorter one is older: missing entries are 0)."""
    if len(a) < len(b):
        a, b = b, a
    return tuple(max(x, y) for x, y in zip(a, b)) + a[len(b):]


class _Token:
    """What a submitted task carries from the submitting thread (a hand-off object of its own)."""

    __slots__ = ("__weakref__",)


def install() -> None:
    """Patch the threading primitives once per process; they do nothing while no watch is active."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True

    start, bootstrap, join = threading.Thread.start, threading.Thread._bootstrap_inner, threading.Thread.join

    @functools.wraps(start)
    def thread_start(self: threading.Thread) -> None:
        watch = _watch()
        if watch is not None and not getattr(self, "_kvz_own", False):  # not a sanitizer's own thread
            with _Hooked():
                self._kvz_started = (watch, watch.thread_starting(self))  # type: ignore[attr-defined]
        start(self)

    def thread_bootstrap(self: threading.Thread) -> None:
        # Until the thread's own run() starts, nothing it does is the program's: above all not the
        # Event that tells Thread.start it has started, while the starter may hold the watch's lock.
        _HOOKED.busy = True
        entry = getattr(self, "_kvz_started", None)
        watch = _ACTIVE[-1] if _ACTIVE else None
        if entry is None or watch is None or entry[0] is not watch:
            bootstrap(self)  # a sanitizer's own thread, or one started while none watched: not followed
            return
        # The hooks run inside run(), after the thread told its starter it has started: Thread.start
        # waits for that, and may hold the watch's lock meanwhile.
        run = self.run

        def watched_run() -> None:
            finish = watch.thread_running(self, entry[1])
            _HOOKED.busy = False
            try:
                run()
            finally:
                with _Hooked():
                    finish()

        self.run = watched_run  # type: ignore[method-assign]
        bootstrap(self)

    @functools.wraps(join)
    def thread_join(self: threading.Thread, timeout: float | None = None) -> None:
        join(self, timeout)
        watch = _watch()
        if watch is not None and not self.is_alive():
            with _Hooked():
                watch.acquire(self)

    threading.Thread.start = thread_start  # type: ignore[method-assign]
    threading.Thread._bootstrap_inner = thread_bootstrap  # type: ignore[attr-defined]
    threading.Thread.join = thread_join  # type: ignore[method-assign]

    def releasing(cls: type, name: str) -> None:
        original = getattr(cls, name)

        @functools.wraps(original)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            watch = _watch()
            if watch is not None:
                with _Hooked():
                    watch.release(self)
            return original(self, *args, **kwargs)

        setattr(cls, name, call)

    def acquiring(cls: type, name: str, *, when: Callable[[Any], bool] = lambda result: True) -> None:
        original = getattr(cls, name)

        @functools.wraps(original)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            watch = _watch()
            if watch is not None and when(result):
                with _Hooked():
                    watch.acquire(self)
            return result

        setattr(cls, name, call)

    releasing(queue.Queue, "put")
    acquiring(queue.Queue, "get")
    releasing(threading.Event, "set")
    acquiring(threading.Event, "wait", when=bool)
    releasing(threading.Condition, "notify")
    releasing(threading.Condition, "notify_all")
    acquiring(threading.Condition, "wait", when=bool)
    acquiring(threading.Condition, "wait_for", when=bool)
    releasing(concurrent.futures.Future, "set_result")
    releasing(concurrent.futures.Future, "set_exception")
    acquiring(concurrent.futures.Future, "result")
    acquiring(concurrent.futures.Future, "exception")

    submit = concurrent.futures.ThreadPoolExecutor.submit

    @functools.wraps(submit)
    def executor_submit(self: Any, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        watch = _watch()
        if watch is None:
            return submit(self, fn, *args, **kwargs)
        token = _Token()
        with _Hooked():
            watch.release(token)

        @functools.wraps(fn)
        def task(*a: Any, **k: Any) -> Any:
            current = _watch()
            if current is not watch:
                return fn(*a, **k)
            with _Hooked():
                teardown = watch.thread_setup()  # a worker that started before the sanitizer did
                watch.acquire(token)
            try:
                return fn(*a, **k)
            finally:
                if teardown is not None:
                    teardown()

        return submit(self, task, *args, **kwargs)

    concurrent.futures.ThreadPoolExecutor.submit = executor_submit  # type: ignore[method-assign]
