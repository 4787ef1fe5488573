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
  the controller alone, which would otherwise wait for execnet to stop each busy worker;
* the process ends within :data:`FORCE_AFTER_S` whatever it was waiting on: a thread blocked in
  a native call (a CUDA copy behind a closed gate kernel, on a GPU) may never return to let the
  ``KeyboardInterrupt`` unwind, and a controller waits for its workers. Past that deadline a
  watchdog thread writes every thread's stack to stderr, runs the last rites registered with
  :func:`on_force` (every gate opened: :mod:`racecheck.gate`), kills the workers and ends the
  process with :func:`forced_status` (2, or 1 once :func:`note_found` said a finding was saved).
  Should that thread never get the GIL, SIGALRM's default action ends the process 2.5 s later.

Example::

    install(until_started=True)   # when the pytest plugin is imported, in the controller and every worker
    started()          # in pytest_configure, once every plugin is imported
    forward_to(pid)    # in the controller, for each xdist worker it starts
    ...
    interrupted()      # True after Ctrl-C or SIGTERM
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

_INTERRUPTED = threading.Event()
_CHILDREN: set[int] = set()  # worker processes the interruption is passed on to
SIGNALS = ("SIGINT", "SIGTERM")
FORWARDED = signal.SIGINT  # what a worker is sent: Ctrl-C, which it treats like SIGTERM
# Seconds from the first signal to the forced end. The promise is 10 s; a worker's own deadline
# starts when the controller forwards the signal, a moment later, so the controller, which kills
# its workers when it is forced, is the last to go.
FORCE_AFTER_S = 7.0
_LAST_RITES: list[Callable[[], None]] = []
_FOUND = threading.Event()
_STATUS: list[Callable[[], int]] = []  # a command's own forced status (set_forced_status)
_GENERATION = [0]  # bumped by reset(): a pending deadline of a forgotten interruption stands down
_sleep = time.sleep  # the real one: racecheck.thread_hooks may wrap time.sleep later
# The process's stderr as it was when the handlers were installed: pytest's output capture points
# fd 2 at a temporary file during a test, which a forced end never prints.
_TERMINAL: list[int] = []


def interrupted() -> bool:
    """Whether this process has been asked to stop."""
    return _INTERRUPTED.is_set()


def mark_interrupted() -> None:
    _INTERRUPTED.set()


def reset() -> None:
    """Forget an interruption (tests that interrupt on purpose, in process): its deadline too."""
    _INTERRUPTED.clear()
    _GENERATION[0] += 1
    with contextlib.suppress(ValueError, OSError):
        signal.setitimer(signal.ITIMER_REAL, 0)


def forward_to(pid: int) -> None:
    """Pass this process's interruption on to process ``pid`` (a pytest-xdist worker), now if
    it has already come."""
    _CHILDREN.add(pid)
    if _INTERRUPTED.is_set():
        _send(pid)


def on_force(rite: Callable[[], None]) -> None:
    """Run ``rite`` (quick, never raising on purpose) before a forced end of the process."""
    _LAST_RITES.append(rite)


def note_found() -> None:
    """A finding of this run is saved: a forced end exits 1, not 2."""
    _FOUND.set()


def set_forced_status(status: Callable[[], int]) -> None:
    """A command whose interrupted status is its own (the sanitizer's 1 or 130): ``status()`` gives
    it, and may print what the command had seen, at a forced end."""
    _STATUS[:] = [status]


def forced_status() -> int:
    """The exit status of a run ended by force: the command's own (:func:`set_forced_status`), else
    1 once a finding was saved (:func:`note_found`), else 2 (interrupted)."""
    if _STATUS:
        with contextlib.suppress(Exception):
            return int(_STATUS[0]())
    return 1 if _FOUND.is_set() else 2


def _force_later(name: str, after_s: float) -> None:
    """The deadline of an interruption (module docstring), from the main thread's signal handler."""
    generation = _GENERATION[0]
    # A thread stuck in native code that holds the GIL would keep the watchdog below from ever
    # running: below it, the kernel ends the process (SIGALRM's default action), 2.5 s later.
    with contextlib.suppress(ValueError, OSError):
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.setitimer(signal.ITIMER_REAL, after_s + 2.5)

    def force() -> None:
        deadline = time.monotonic() + after_s
        while time.monotonic() < deadline:
            _sleep(0.05)
            if _GENERATION[0] != generation:
                return  # reset(): the interruption was forgotten
        terminal = _TERMINAL[0] if _TERMINAL else sys.stderr.fileno()
        with contextlib.suppress(Exception):  # a closed stderr must not keep the process alive
            os.write(terminal, f"still running {after_s:g} s after {name}: ending the process by force; "
                               f"each thread was here:\n".encode())
            faulthandler.dump_traceback(file=terminal, all_threads=True)
        for rite in list(_LAST_RITES):
            with contextlib.suppress(Exception):
                rite()
        for pid in sorted(_CHILDREN):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        os._exit(forced_status())

    thread = threading.Thread(target=force, name="kvz-interrupt-deadline", daemon=True)
    thread._kvz_own = True  # type: ignore[attr-defined]  # the tool's own: no thread watch follows it
    thread.start()


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
        _force_later(signal.Signals(signum).name, FORCE_AFTER_S)
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
    if not _TERMINAL:
        with contextlib.suppress(OSError):
            _TERMINAL.append(os.dup(2))
    _STARTING[0] = _STARTING[0] or until_started
    return True


def started() -> None:
    """Start-up is over (every plugin imported): an interrupt now raises ``KeyboardInterrupt``."""
    _STARTING[0] = False
