"""Every Python thread followed: its CUDA work, and the hand-offs that order it after other threads.

Streams are per thread in CUDA and torch, and engines issue work from helper threads (vLLM's async
output thread copies sampled tokens to the host on its own copy stream; SGLang's cache controller
loads and stores KV from threads of its own; vLLM's SimpleCPUOffload copies from a background
thread fed by a ``queue.SimpleQueue``). While a tool (the sanitizer, or the fuzzer's intercepted
code) watches:

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

The watch (:class:`ThreadWatch`) decides what "set up" means for its backend; :class:`HandOffs` is
the clock bookkeeping both backends share. A watch that schedules threads itself (the fuzzer's, over
:class:`racecheck.turns.Turns`, so that a run replays) also answers :meth:`ThreadWatch.wait_turn`:
every primitive that would block asks it first, with the condition it waits for. The fuzzer's
intercepted code creates its ``queue.SimpleQueue`` as :class:`FollowedSimpleQueue` (a C type's
methods cannot be patched), which is followed the same way.

Example::

    install()                                # once per process: the patches below
    deactivate = activate(observer)          # the observer implements ThreadWatch
    t = threading.Thread(target=work); t.start(); t.join()   # work() is followed; join orders it
    deactivate()
"""

from __future__ import annotations

import concurrent.futures
import functools
import inspect
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from racecheck.turns import TurnsClosed


# The sleep the hooks below leave alone: a tool's own back-off (polling the GPU for a gate's op)
# inside a followed thread is not the program's timed wait, so it must not yield the thread's turn.
unhooked_sleep = time.sleep


class ThreadWatch(Protocol):
    def thread_starting(self, thread: threading.Thread) -> Any: ...
    def thread_running(self, thread: threading.Thread, token: Any) -> Callable[[], None]: ...
    def thread_setup(self) -> Callable[[], None] | None: ...
    def release(self, obj: Any) -> None: ...
    def acquire(self, obj: Any) -> None: ...
    # Optional: ``wait_turn(obj, condition, timeout)`` before a primitive blocks on ``obj`` until
    # ``condition()``: None (not scheduled here: block as usual), True (it holds now), False (timed out).


def _turn(obj: Any, condition: Callable[[], bool], timeout: float | None) -> bool | None:
    """What a scheduling watch says of a wait about to block (None: no such watch, or not its thread)."""
    watch = _watch()
    wait_turn = getattr(watch, "wait_turn", None)
    if wait_turn is None:
        return None
    return wait_turn(obj, condition, timeout)


_ACTIVE: list[ThreadWatch] = []
_INSTALLED = False


def activate(watch: ThreadWatch) -> Callable[[], None]:
    """Follow threads for ``watch`` until the returned function is called."""
    install()
    _ACTIVE.append(watch)
    return lambda: deactivate(watch)


def deactivate(watch: ThreadWatch) -> None:
    """Stop following threads for ``watch`` (what :func:`activate`'s returned function does; a
    watch no longer active is left alone)."""
    if watch in _ACTIVE:
        _ACTIVE.remove(watch)


def watches() -> list[ThreadWatch]:
    """The watches active now, innermost last: the patched primitives act for the last one."""
    return list(_ACTIVE)


def followed_threads() -> list[tuple[threading.Thread, ThreadWatch]]:
    """The threads alive now that were started while a watch followed them, each with that watch."""
    followed = []
    for thread in threading.enumerate():
        entry = getattr(thread, "_kvz_started", None)
        if entry is not None and thread.is_alive():
            followed.append((thread, entry[0]))
    return followed


_HOOKED = threading.local()  # per thread: a hook is running (what it calls is not the program's)


def _watch() -> ThreadWatch | None:
    if not _ACTIVE or getattr(_HOOKED, "busy", False):
        return None
    return _ACTIVE[-1]


class _Hooked:
    """While a hook runs, the primitives it uses (an Event inside a dummy thread, say) are not hooked again."""

    def __enter__(self) -> None:
        self._was = getattr(_HOOKED, "busy", False)
        _HOOKED.busy = True

    def __exit__(self, *exc: object) -> None:
        _HOOKED.busy = self._was


def _hand_off(obj: Any, *, release: bool) -> None:
    """``obj`` is released (a put, a set, a notify) or acquired (a get, a wait) by the calling thread."""
    watch = _watch()
    if watch is not None:
        with _Hooked():
            (watch.release if release else watch.acquire)(obj)


def unwatched() -> _Hooked:
    """Inside, the calling thread's primitives are not hooked: the tool's own work (a scheduler
    letting the simulated device run while every thread waits) is not the program's."""
    return _Hooked()


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
    """Patch the threading primitives once per process; they do nothing while no watch is active.
    One installer per family of primitives (:data:`_FAMILIES`), as PyTorch's CUDA sanitizer has
    one handler per trace callback."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    for hook in _FAMILIES:
        hook()


# -- how a primitive is followed: the wrappers each family's installer applies ---------------------
def _releasing(cls: type, name: str) -> None:
    """``cls.name`` hands off: the calling thread releases the object (a put, a set, a notify)."""
    original = getattr(cls, name)

    @functools.wraps(original)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        _hand_off(self, release=True)
        return original(self, *args, **kwargs)

    setattr(cls, name, call)


def _acquiring(cls: type, name: str, *, when: Callable[[Any], bool] = lambda result: True) -> None:
    """``cls.name`` receives a hand-off once it returns a result ``when`` accepts (a wait that did
    not time out)."""
    original = getattr(cls, name)

    @functools.wraps(original)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if when(result):
            _hand_off(self, release=False)
        return result

    setattr(cls, name, call)


def _blocking(cls: type, name: str, condition: Callable[..., bool], timed_out: Callable[[], Any]) -> None:
    """``cls.name(self, ..., block/timeout)`` asks a scheduling watch before it would block. Applied
    before :func:`_acquiring` on the same method, so the hand-off follows the turn."""
    original = getattr(cls, name)
    parameters = list(inspect.signature(original).parameters)

    @functools.wraps(original)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = dict(zip(parameters[1:], args), **kwargs)
        if bound.get("block", True):
            if _turn(self, lambda: condition(self, bound), bound.get("timeout")) is False:
                return timed_out()
        return original(self, *args, **kwargs)

    setattr(cls, name, call)


def _raise(error: type[BaseException]) -> Callable[[], Any]:
    def timed_out() -> Any:
        raise error()
    return timed_out


# -- one installer per family -----------------------------------------------------------------------
def _hook_threads() -> None:
    """``Thread.start`` sets a thread up for the watch before its target runs; ``join`` receives
    what the joined thread had seen."""
    start, bootstrap, join = threading.Thread.start, threading.Thread._bootstrap_inner, threading.Thread.join

    @functools.wraps(start)
    def thread_start(self: threading.Thread) -> None:
        if getattr(self, "_kvz_own", False):
            # A tool's own thread (the gate watchdog, started lazily inside the first gated op of
            # the code under test): Thread.start waits for an Event the new thread sets, which is
            # the tool's wait, not a turn of the program (as one it was a false TurnDeadlock).
            with _Hooked():
                start(self)
            return
        watch = _watch()
        if watch is not None:
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
            try:
                finish = watch.thread_running(self, entry[1])
            except TurnsClosed:  # its turns ended before it ever ran
                return
            _HOOKED.busy = False
            try:
                run()
            except TurnsClosed:  # parked when its turns ended: the thread ends quietly
                pass
            finally:
                with _Hooked():
                    finish()

        self.run = watched_run  # type: ignore[method-assign]
        bootstrap(self)

    @functools.wraps(join)
    def thread_join(self: threading.Thread, timeout: float | None = None) -> None:
        if _turn(self, lambda: not self.is_alive(), timeout) is False:
            return  # timed out: still alive
        join(self, timeout)
        if not self.is_alive():
            _hand_off(self, release=False)

    threading.Thread.start = thread_start  # type: ignore[method-assign]
    threading.Thread._bootstrap_inner = thread_bootstrap  # type: ignore[attr-defined]
    threading.Thread.join = thread_join  # type: ignore[method-assign]


def _hook_queues() -> None:
    """``queue.Queue``: a put hands off to the get that takes it; both wait their turn to block."""
    _blocking(queue.Queue, "get", lambda q, _: not q.empty(), _raise(queue.Empty))
    _blocking(queue.Queue, "put", lambda q, _: not q.full(), _raise(queue.Full))
    _releasing(queue.Queue, "put")
    _acquiring(queue.Queue, "get")


def _hook_events() -> None:
    """``threading.Event``: a set hands off to a wait that saw it set."""
    _blocking(threading.Event, "wait", lambda e, _: e.is_set(), lambda: False)
    _releasing(threading.Event, "set")
    _acquiring(threading.Event, "wait", when=bool)
    _acquiring(threading.Event, "is_set", when=bool)  # polled until set: the same hand-off


def _hook_conditions() -> None:
    """``threading.Condition``: a notify hands off to a wait it ended, and to whoever takes the lock after."""
    _hook_condition_wait()
    _releasing(threading.Condition, "notify")
    _releasing(threading.Condition, "notify_all")
    _acquiring(threading.Condition, "wait", when=bool)
    _acquiring(threading.Condition, "wait_for", when=bool)
    # ``with cond: while not ready: cond.wait()`` calls no wait() where the notify came first:
    # taking the Condition's lock after the notifier let it go is the hand-off then.
    _acquiring(threading.Condition, "__enter__")


def _hook_futures() -> None:
    """``concurrent.futures.Future``: its result (or exception) set hands off to whoever reads it."""
    timed_out = _raise(concurrent.futures.TimeoutError)
    _blocking(concurrent.futures.Future, "result", lambda f, _: f.done(), timed_out)
    _blocking(concurrent.futures.Future, "exception", lambda f, _: f.done(), timed_out)
    _releasing(concurrent.futures.Future, "set_result")
    _releasing(concurrent.futures.Future, "set_exception")
    _acquiring(concurrent.futures.Future, "result")
    _acquiring(concurrent.futures.Future, "exception")


def _hook_executors() -> None:
    """``ThreadPoolExecutor.submit`` hands off to the task, in a worker set up for the watch."""
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


def _hook_sleep() -> None:
    """``time.sleep``: under a scheduling watch a timed wait passes the turn instead of sleeping."""
    sleep = time.sleep

    @functools.wraps(sleep)
    def time_sleep(seconds: float) -> None:
        if _turn(time, lambda: False, seconds) is None:
            sleep(seconds)

    time.sleep = time_sleep


def _hook_condition_wait() -> None:
    """``Condition.wait`` under a scheduling watch: the lock is let go, the turn passes until a
    notify that came after the wait began (or the timeout), and the lock is taken back."""
    wait, notify, notify_all = threading.Condition.wait, threading.Condition.notify, threading.Condition.notify_all

    @functools.wraps(wait)
    def condition_wait(self: threading.Condition, timeout: float | None = None) -> bool:
        watch = _watch()
        if getattr(watch, "wait_turn", None) is None or not watch.scheduling():  # type: ignore[union-attr]
            return wait(self, timeout)
        woken = [False]
        waiters = self.__dict__.setdefault("_kvz_turn_waiters", [])
        waiters.append(woken)
        saved = self._release_save()  # type: ignore[attr-defined]
        try:
            got = _turn(self, lambda: woken[0], timeout)
        finally:
            self._acquire_restore(saved)  # type: ignore[attr-defined]
            if woken in waiters:
                waiters.remove(woken)
        return bool(got)

    @functools.wraps(notify)
    def condition_notify(self: threading.Condition, n: int = 1) -> None:
        for woken in list(self.__dict__.get("_kvz_turn_waiters", ()))[:n]:
            woken[0] = True
            self._kvz_turn_waiters.remove(woken)  # type: ignore[attr-defined]
        notify(self, n)

    @functools.wraps(notify_all)
    def condition_notify_all(self: threading.Condition) -> None:
        for woken in self.__dict__.get("_kvz_turn_waiters", ()):
            woken[0] = True
        self.__dict__.get("_kvz_turn_waiters", []).clear()
        notify_all(self)

    threading.Condition.wait = condition_wait  # type: ignore[method-assign]
    threading.Condition.notify = condition_notify  # type: ignore[method-assign]
    threading.Condition.notify_all = condition_notify_all  # type: ignore[method-assign]


# Every family install() patches, in the order it patches them.
_FAMILIES: tuple[Callable[[], None], ...] = (
    _hook_threads, _hook_queues, _hook_events, _hook_futures, _hook_conditions, _hook_sleep, _hook_executors,
)


class FollowedSimpleQueue(queue.SimpleQueue):
    """``queue.SimpleQueue`` whose ``put``/``get`` are hand-offs the watch follows (and, under a
    scheduling watch, whose ``get`` waits for its turn), as ``queue.Queue``'s are."""

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        _hand_off(self, release=True)
        super().put(item, block, timeout)

    def put_nowait(self, item: Any) -> None:
        self.put(item, False)

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if block and _turn(self, lambda: not self.empty(), timeout) is False:
            raise queue.Empty
        item = super().get(block, timeout)
        _hand_off(self, release=False)
        return item

    def get_nowait(self) -> Any:
        return self.get(False)
