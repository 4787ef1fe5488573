"""Ctrl-C and SIGTERM: stop promptly, judge nothing that was cut off, lose nothing already found.

The first SIGINT or SIGTERM marks the process interrupted and raises ``KeyboardInterrupt`` where
the main thread is, as Ctrl-C always does (SIGTERM, which would otherwise kill the process on the
spot, takes the same path, so pytest and the campaign's own ``finally`` blocks run). From then on:

* an episode cut off mid-op is thrown away, never judged (:meth:`ZeroerMachine.teardown`), so an
  interruption cannot fabricate a finding;
* no new example starts;
* a finding already made was saved as a trace file when it was made, and the run's summary is
  written marked ``"partial": true``, next to a complete summary rather than over it
  (:mod:`fuzz.engine.summary`).

Example::

    install()          # in the pytest plugin's configure hook, in the controller and every worker
    ...
    interrupted()      # True after Ctrl-C or SIGTERM
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

_INTERRUPTED = threading.Event()
SIGNALS = ("SIGINT", "SIGTERM")


def interrupted() -> bool:
    """Whether this process has been asked to stop."""
    return _INTERRUPTED.is_set()


def mark_interrupted() -> None:
    _INTERRUPTED.set()


def reset() -> None:
    """Forget an interruption (tests that interrupt on purpose, in process)."""
    _INTERRUPTED.clear()


def _handle(signum: int, frame: FrameType | None) -> Any:
    first = not _INTERRUPTED.is_set()
    _INTERRUPTED.set()
    if first:
        raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


def install() -> bool:
    """Install the handlers (main thread only, where Python delivers signals); True if installed."""
    if threading.current_thread() is not threading.main_thread():
        return False
    for name in SIGNALS:
        signal.signal(getattr(signal, name), _handle)
    return True
