"""Ctrl-C and SIGTERM: stop promptly, judge nothing that was cut off, lose nothing already found.

The first SIGINT or SIGTERM marks the process interrupted and raises ``KeyboardInterrupt`` where
the main thread is, as Ctrl-C always does (SIGTERM, which would otherwise kill the process on the
spot, takes the same path, so pytest and the campaign's own ``finally`` blocks run). From then on:

* an episode cut off mid-op is thrown away, never judged (:meth:`fuzz.engine.machine.CallerMachine.teardown`), so an
  interruption cannot fabricate a finding;
* no new example starts;
* a finding already made is kept: a campaign that ended wrote its trace file then, and one cut
  off while shrinking or minimising writes the smallest program that showed it so far
  (:func:`~fuzz.engine.campaigns.run_campaign`); the run's summary is written marked
  ``"partial": true``, next to a complete summary rather than over it (:mod:`fuzz.engine.summary`);
* the interruption reaches this process's pytest-xdist workers too (:func:`forward_to`): Ctrl-C
  in a terminal signals the whole process group, but ``kill`` or a CI runner's cancel signals
  the controller alone, which would otherwise wait for execnet to stop each busy worker.

Example::

    install(until_started=True)   # when the pytest plugin is imported, in the controller and every worker
    started()          # in pytest_configure, once every plugin is imported
    forward_to(pid)    # in the controller, for each xdist worker it starts
    ...
    interrupted()      # True after Ctrl-C or SIGTERM
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from types import FrameType
from typing import Any

_INTERRUPTED = threading.Event()
_CHILDREN: set[int] = set()  # worker processes the interruption is passed on to
SIGNALS = ("SIGINT", "SIGTERM")
FORWARDED = signal.SIGINT  # what a worker is sent: Ctrl-C, which it treats like SIGTERM


def interrupted() -> bool:
    """Whether this process has been asked to stop."""
    return _INTERRUPTED.is_set()


def mark_interrupted() -> None:
    _INTERRUPTED.set()


def reset() -> None:
    """Forget an interruption (tests that interrupt on purpose, in process)."""
    _INTERRUPTED.clear()


def forward_to(pid: int) -> None:
    """Pass this process's interruption on to process ``pid`` (a pytest-xdist worker), now if
    it has already come."""
    _CHILDREN.add(pid)
    if _INTERRUPTED.is_set():
        _send(pid)


def forget(pid: int) -> None:
    """``pid`` has exited: never signal it (the number may be reused)."""
    _CHILDREN.discard(pid)


def _send(pid: int) -> None:
    with contextlib.suppress(OSError):  # already gone
        os.kill(pid, FORWARDED)


_STARTING = [False]  # install(until_started=True) until started(): see _handle


def _handle(signum: int, frame: FrameType | None) -> Any:
    first = not _INTERRUPTED.is_set()
    _INTERRUPTED.set()
    if first:
        for pid in sorted(_CHILDREN):
            _send(pid)
        if _STARTING[0]:
            # Still starting up: the KeyboardInterrupt would land in whatever is being imported (a
            # pytest plugin's class body, where Python 3.11 turns it into "RuntimeError: Error
            # calling __set_name__", which pytest reports as an internal error, exit 3). Nothing
            # has run or been written yet: end the process by the signal, as without a handler.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return None
        raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


def install(*, until_started: bool = False) -> bool:
    """Install the handlers (main thread only, where Python delivers signals); True if installed.
    ``until_started``: until :func:`started`, an interrupt ends the process by its signal."""
    if threading.current_thread() is not threading.main_thread():
        return False
    for name in SIGNALS:
        signal.signal(getattr(signal, name), _handle)
    _STARTING[0] = _STARTING[0] or until_started
    return True


def started() -> None:
    """Start-up is over (every plugin imported): an interrupt now raises ``KeyboardInterrupt``."""
    _STARTING[0] = False
