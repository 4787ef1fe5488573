"""One sanitized run: pick the backend, start the sanitizer, run the program, collect the verdict.

The command (:mod:`sanitizer.__main__`), the pytest plugin (:mod:`sanitizer.pytest_plugin`)
and the benchmark (:mod:`sanitizer.bench`) all go through here, so a program gets the same
verdict however it is run: on a GPU the observer (:mod:`sanitizer.observer`, plus
:mod:`sanitizer.forcing` in force mode), elsewhere the simulator (:mod:`sanitizer.simulated`).

Example::

    outcome = sanitize(lambda: runpy.run_path("prog.py", run_name="__main__"), backend="auto")
    outcome.races        # [Race(...)]: a finding
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fuzz.cli import UsageError
from sanitizer.races import Race

BACKENDS = ("auto", "cuda", "sim")
MODES = ("observe", "force")


@dataclass
class Outcome:
    """What one sanitized run found."""

    backend: str
    mode: str
    races: list[Race] = field(default_factory=list)
    unfollowed: list[str] = field(default_factory=list)  # one line each: what could not be followed, where
    error: BaseException | None = None  # what the program itself raised
    error_text: str = ""  # its traceback, as Python would print it
    forced_timeouts: int = 0  # force mode: gates that opened by themselves (a window closed early)
    interrupted: bool = False  # Ctrl-C or SIGTERM stopped the program: the races are those seen before it


def prepare(mode: str) -> None:
    """What a run needs set before CUDA starts: in force mode every kernel module is loaded up front,
    since loading one lazily waits for the GPU to drain, which a closed gate keeps from happening."""
    if mode == "force":
        os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")


def resolve_backend(choice: str) -> str:
    """``auto`` is ``cuda`` on a machine with a GPU and ``sim`` elsewhere."""
    if choice not in BACKENDS:
        raise UsageError(f"backend {choice!r} is not one of {', '.join(BACKENDS)}")
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "sim"
    if choice == "cuda" and not torch.cuda.is_available():
        raise UsageError("backend 'cuda' needs a GPU and torch with CUDA, and this machine has none; "
                         "use --backend sim to run the program's cuda work on the simulator")
    return choice


class GpuSanitizer:
    """The observer on a GPU, started and stopped around whatever runs in between."""

    def __init__(self, mode: str = "observe") -> None:
        from sanitizer.forcing import Forcing
        from sanitizer.observer import Observer

        if mode not in MODES:
            raise UsageError(f"mode {mode!r} is not one of {', '.join(MODES)}")
        self.mode = mode
        self.observer = Observer(forcing=Forcing() if mode == "force" else None)

    def start(self) -> None:
        self.observer.start()

    def checkpoint(self) -> tuple[list[Race], list[str]]:
        """End of a scope (a test phase): forced holds released, host checked; what it found."""
        from sanitizer.sites import caller_site

        self.observer.scope_end(caller_site())
        return self.observer.take_races(), [u.message() for u in self.observer.take_unfollowed()]

    def stop(self) -> tuple[list[Race], list[str]]:
        races = self.observer.stop()
        return races, [u.message() for u in self.observer.take_unfollowed()]

    @property
    def timeouts(self) -> int:
        forcing = self.observer.forcing
        return forcing.timeouts if forcing is not None else 0


def sanitize(program: Callable[[], Any], *, backend: str = "auto", mode: str = "observe",
             name: str = "program") -> Outcome:
    """Run ``program`` under the sanitizer; its :class:`Outcome`."""
    backend = resolve_backend(backend)
    if mode not in MODES:
        raise UsageError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    outcome = Outcome(backend, mode)
    if backend == "sim":
        from sanitizer.simulated import run_simulated

        outcome.races, outcome.error = run_simulated(program, name)
        if isinstance(outcome.error, KeyboardInterrupt):
            outcome.interrupted, outcome.error = True, None
        if outcome.error is not None:
            outcome.error_text = "".join(traceback.format_exception(outcome.error))
        return outcome
    sanitizer = GpuSanitizer(mode)
    sanitizer.start()
    try:
        program()
    except KeyboardInterrupt:  # the races seen so far are kept: the caller reports them as such
        outcome.interrupted = True
    except Exception as error:  # noqa: BLE001 - the program's own failure is reported beside its races
        outcome.error = error
        outcome.error_text = "".join(traceback.format_exception(error))
    finally:
        outcome.races, outcome.unfollowed = sanitizer.stop()
        outcome.forced_timeouts = sanitizer.timeouts
    return outcome
