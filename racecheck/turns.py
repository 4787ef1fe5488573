"""Threads that take turns: one runs at a time, and the next is chosen in a fixed order.

Engines issue KV transfers from helper threads: vLLM's SimpleCPUOffload hands each copy to a
background thread through a ``queue.SimpleQueue``; SGLang's cache controller loads and writes KV on
threads fed by queues. A fuzzer that must replay what it found cannot let such threads run when the
OS likes. Under :class:`Turns`, the members (the caller's thread while it is inside the code under
test, and the threads that code starts) run one at a time, as coroutines would:

* a member runs until it would block in a primitive the hooks follow (``Queue.get``,
  ``Event.wait``, ``Thread.join``, ``Future.result``, ``Condition.wait``, ``time.sleep``:
  :mod:`racecheck.thread_hooks`); it then hands the turn on with the condition it waits for;
* the next member is the first, in round-robin order after the one handing on, whose condition
  holds; when none holds, time passes: a virtual clock moves to the earliest deadline of a timed
  wait (``sleep(0.001)`` before ``wait(timeout=60)``), that wait times out, and ``on_idle`` is
  told, so a simulator can let device work progress; when no wait is timed either, every member
  waits for another: :class:`TurnDeadlock`;
* the caller's thread leaves only after :meth:`settle`: every helper has run until it waits.

Which member runs is a function of the members' conditions alone, so a run replays exactly.
Nothing here orders memory: the hand-offs that really order threads are the happens-before
checker's (:class:`racecheck.thread_hooks.HandOffs`); turns only make the schedule repeatable.

Example::

    turns = Turns()
    turns.enter()                                  # the caller takes the turn
    member = turns.add(worker)                     # started by the caller: it waits for its turn
    turns.wait_until(lambda: not q.empty())        # the caller would block: the worker runs
    turns.settle(); turns.leave()
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class TurnDeadlock(RuntimeError):
    """Every member waits for another, with no timeout: the code under test would hang here."""


class TurnsClosed(SystemExit):
    """Raised in a parked helper when its turns are closed: the helper unwinds and ends (a
    SystemExit, which ``threading`` lets end a thread without a traceback)."""


class _Member:
    __slots__ = ("thread", "condition", "deadline", "timed_out", "done", "name")

    def __init__(self, thread: Any, name: str) -> None:
        self.thread, self.name = thread, name
        self.condition: Callable[[], bool] | None = None  # None: runnable
        self.deadline: float | None = None  # a timed wait: when it times out, on the virtual clock
        self.timed_out = False
        self.done = False


class Turns:
    """See the module docstring. ``on_idle()`` runs when a timed wait is let time out."""

    def __init__(self, on_idle: Callable[[], None] | None = None) -> None:
        self._lock = threading.Condition(threading.Lock())
        self._members: list[_Member] = []
        self._by_ident: dict[int, _Member] = {}
        self._holder: _Member | None = None
        self._caller: _Member | None = None
        self._closed = False
        self.now = 0.0  # the virtual clock of timed waits, in seconds
        self.deadlock: str | None = None
        self.on_idle = on_idle

    # -- who is asking ------------------------------------------------------------------------------
    def holding(self) -> bool:
        """Whether the calling thread is the member that has the turn."""
        member = self._by_ident.get(threading.get_ident())
        return member is not None and member is self._holder

    def helper(self, thread: Any) -> _Member | None:
        for member in self._members:
            if member.thread is thread:
                return member
        return None

    # -- the caller's thread -------------------------------------------------------------------------
    def enter(self) -> None:
        """The caller's thread takes the turn (no helper runs while the caller is outside)."""
        with self._lock:
            if self._caller is None:
                self._caller = _Member(threading.current_thread(), "the caller")
            self._caller.condition = None
            self._by_ident[threading.get_ident()] = self._caller
            self._holder = self._caller

    def settle(self) -> None:
        """Let every helper run until it waits (the caller's call is over)."""
        self.wait_until(lambda: not any(self._can_run(m) for m in self._members if m is not self._caller))

    def leave(self) -> None:
        with self._lock:
            self._by_ident.pop(threading.get_ident(), None)
            self._holder = None

    # -- helpers -------------------------------------------------------------------------------------
    def add(self, thread: Any, name: str) -> _Member:
        """A thread the holder is starting: runnable, it runs when the turn comes to it."""
        with self._lock:
            member = _Member(thread, name)
            self._members.append(member)
            return member

    def begin(self, member: _Member) -> None:
        """In the started thread, before its target: wait for the turn."""
        with self._lock:
            self._by_ident[threading.get_ident()] = member
            self._park(member)

    def finish(self, member: _Member) -> None:
        """The thread's target has returned (or raised): it is done, and hands the turn on."""
        with self._lock:
            member.done = True
            self._by_ident.pop(threading.get_ident(), None)
            if self._holder is member:
                self._hand_on(member)

    def close(self) -> None:
        """End every parked helper (each unwinds with :class:`TurnsClosed`)."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()

    # -- blocking ------------------------------------------------------------------------------------
    def wait_until(self, condition: Callable[[], bool], timeout: float | None = None) -> bool:
        """Called by the member that has the turn where it would block until ``condition``: True
        once it holds, False where the wait timed out (nothing else could run)."""
        with self._lock:
            member = self._by_ident.get(threading.get_ident())
            if member is None or member is not self._holder:
                raise RuntimeError("wait_until() outside a turn")  # the hooks ask holding() first
            if condition():
                return True
            member.condition, member.timed_out = condition, False
            member.deadline = self.now + max(0.0, float(timeout)) if timeout is not None else None
            self._hand_on(member)
            self._park(member)
            member.condition, member.deadline = None, None
            if member is self._caller and self.deadlock is not None:
                said, self.deadlock = self.deadlock, None
                raise TurnDeadlock(f"deadlock: every thread waits for another, none with a timeout ({said}); "
                                   f"the code would hang here")
            return not member.timed_out

    def wait_turn(self, obj: Any, condition: Callable[[], bool], timeout: float | None) -> bool | None:
        """What a blocking primitive on ``obj`` asks (:mod:`racecheck.thread_hooks`): None when the
        calling thread does not hold the turn (it blocks as usual), else :meth:`wait_until`. A join
        of a helper waits for its target to end, not its OS thread, which may linger a moment."""
        if not self.holding():
            return None
        member = self.helper(obj) if isinstance(obj, threading.Thread) else None
        if member is not None:
            condition = lambda: member.done  # noqa: E731
        return self.wait_until(condition, timeout)

    # -- the choice ----------------------------------------------------------------------------------
    @staticmethod
    def _can_run(member: _Member) -> bool:
        return not member.done and (member.condition is None or bool(member.condition()))

    def _candidates(self) -> list[_Member]:
        """The caller while it is inside, then the helpers not done, in the order they started."""
        inside = self._caller is not None and self._caller in self._by_ident.values()
        return ([self._caller] if inside else []) + [m for m in self._members if not m.done]

    def _hand_on(self, member: _Member) -> None:
        """Choose the next member (the module docstring's rule) and wake it."""
        order = self._candidates()
        start = order.index(member) + 1 if member in order else 0
        rotated = order[start:] + order[:start]  # round robin: ``member`` itself comes last
        chosen = next((m for m in rotated if self._can_run(m)), None)
        if chosen is None:
            timed = [m for m in rotated if m.deadline is not None and m.condition is not None]
            if timed:
                chosen = min(timed, key=lambda m: m.deadline)  # the earliest; ties in round-robin order
                self.now = max(self.now, chosen.deadline)
                chosen.timed_out = True
                if self.on_idle is not None:
                    self.on_idle()
        if chosen is None and self._caller in order:
            # Every thread waits for another: the caller's wait raises, so the harness hears of it.
            chosen = self._caller
            self.deadlock = "; ".join(f"{m.name} waits" for m in order)
        self._holder = chosen
        self._lock.notify_all()

    def _park(self, member: _Member) -> None:
        while self._holder is not member:
            if self._closed and member is not self._caller:
                raise TurnsClosed()
            self._lock.wait()
