"""Threads the code under test starts: followed, ordered by what really orders them, and replayable.

vLLM's SimpleCPUOffload issues its copies from a background thread fed by a ``queue.SimpleQueue``;
SGLang's cache controller loads and writes KV on threads of its own. Under interception such a
thread runs the component's torch work through the same session as the calling thread (its own
torch modes, its own current stream, a host thread of the happens-before checker that knows what
its starter knew), and the hand-offs between threads (:mod:`racecheck.thread_hooks`: start, join,
queues, events, conditions, futures) are the only host-side order the checker takes from them.

So that a finding replays, the threads take turns (:class:`racecheck.turns.Turns`): one runs at a
time, a thread runs until it would block, and the caller's call ends only once every helper is
waiting again. A helper therefore runs inside some call of the component (the one that fed it, or
a later one that waits for it), never between the caller's own ops. Where every thread waits for
another, the caller's call raises :class:`~racecheck.turns.TurnDeadlock` (the code would hang).
A thread blocking on something the hooks do not see (a lock held by a thread that waits, a socket)
blocks the run; the turns are then stuck, which :meth:`HelperThreads.close` ends.

Example (inside an offloader's intercepted constructor)::

    self._queue = queue.SimpleQueue()             # a FollowedSimpleQueue while the session runs
    threading.Thread(target=self._copy_loop, daemon=True).start()
    # store(): self._queue.put(job) -> the loop runs when the call ends, and its copies are queued then
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any

from racecheck import thread_hooks
from racecheck.turns import TurnDeadlock, Turns
from kvdevice.intercept.errors import raise_as_cuda


class HelperThreads:
    """The thread watch of one intercept session (``session``: its runtime, modes and boundary)."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.rt = session.rt
        self.turns = Turns(on_idle=self._time_passes)
        self.handoffs = thread_hooks.HandOffs(self.rt.hb, self.rt.threads)
        self._deactivate: Callable[[], None] | None = None

    # -- the caller's call ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def calling(self) -> Any:
        """Inside: the caller's thread holds the turn, and the session's threads are followed."""
        thread_hooks.install()
        self._deactivate = thread_hooks.activate(self)
        try:
            self.turns.enter()
            try:
                yield
            finally:
                self.turns.leave()
        finally:  # whatever entering or leaving the turns raised: no watch stays active past the call
            self._deactivate()

    def settle(self) -> None:
        """At the end of a call: every helper runs until it waits."""
        self.turns.settle()

    def close(self) -> None:
        self.turns.close()

    def patches(self) -> list[tuple[Any, dict[str, Any]]]:
        """``queue.SimpleQueue`` made inside the code under test is followed (a C type cannot be hooked)."""
        return [(queue, {"SimpleQueue": thread_hooks.FollowedSimpleQueue})]

    # -- racecheck.thread_hooks.ThreadWatch ---------------------------------------------------------
    def scheduling(self) -> bool:
        return self.turns.holding()

    def wait_turn(self, obj: Any, condition: Callable[[], bool], timeout: float | None) -> bool | None:
        try:
            return self.turns.wait_turn(obj, condition, timeout)
        except TurnDeadlock as deadlock:
            # The code's own wait can never end: its hang, raised at its call (kvdevice.origin)
            raise_as_cuda(TurnDeadlock(str(deadlock)))
            raise  # not reached

    def thread_starting(self, thread: threading.Thread) -> Any:
        if not self.turns.holding() or getattr(thread, "_kvz_own", False):
            return None
        self.session.boundary(f"the start of thread '{thread.name}'")
        snapshot = self.rt.hb.host_snapshot(self.rt.host_thread())
        return snapshot, self.turns.add(thread, f"thread '{thread.name}'")

    def thread_running(self, thread: threading.Thread, token: Any) -> Callable[[], None]:
        if token is None:
            return lambda: None
        snapshot, member = token
        self.rt.threads.started_from(snapshot, threading.get_ident(), thread.name, thread)
        modes = contextlib.ExitStack()
        self.turns.begin(member)  # TurnsClosed (a SystemExit: the thread ends quietly) if the session ended
        for mode in self.session.modes():  # torch modes are per thread
            modes.enter_context(mode)

        def finish() -> None:
            try:
                modes.close()
                if self.turns.holding():
                    self.session.boundary(f"the end of thread '{thread.name}'")
                    self.handoffs.release(thread)
            finally:
                self.rt.threads.ended(threading.get_ident())
                self.turns.finish(member)

        return finish

    def thread_setup(self) -> Callable[[], None] | None:
        return None

    def release(self, obj: Any) -> None:
        if self.turns.holding():
            self.handoffs.release(obj)

    def acquire(self, obj: Any) -> None:
        if self.turns.holding():
            self.handoffs.acquire(obj)

    # -- time ----------------------------------------------------------------------------------------
    def _time_passes(self) -> None:
        """Every thread waits and one of them only for a while: the device makes progress meanwhile
        (a helper polling an event sees it complete), one op of each stream, without the host
        learning of it."""
        if self.rt.scheduled:
            with thread_hooks.unwatched():  # the device's work is not the code's (and the turns are held)
                for stream in self.rt.streams:
                    self.rt.advance(stream, 1)
