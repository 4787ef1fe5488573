"""One sanitized run: pick the backend, start the sanitizer, run the program, collect the verdict.

The command (:mod:`sanitizer.__main__`), the pytest plugin (:mod:`sanitizer.pytest_plugin`) and
the benchmark (:mod:`sanitizer.bench`) all go through here, so a program gets the same verdict
however it is run: on a GPU the observer (:mod:`sanitizer.gpu`, with force mode's gates when
asked), elsewhere the simulator (:mod:`sanitizer.sim`).

Force mode on a GPU and its failures. Holding a copy until the host next synchronises is a
schedule the GPU could have chosen, so a race-free program gives the same results under it. When a
program fails in force mode while a device-to-host copy into pinned memory is still held, and no read
of that memory was seen (it went through memory the sanitizer does not watch: ``np.asarray`` of a
view, ``memoryview``, a C extension), the failure is reported as the race it shows: a host read of
that buffer under the held copy, naming the copy and the buffer (:func:`unseen_reads`).

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

from racecheck.cli import INTERNAL, USAGE, UsageError
from racecheck.custom_ops import failed_inside
from sanitizer.races import Access, Race
from kvdevice.origin import HARNESS_MODULES, blame, describe_frame
from kvdevice.runtime import BACKENDS, resolve_backend as runtime_backend

MODES = ("observe", "force")


@dataclass
class Outcome:
    """What one sanitized run found."""

    backend: str
    mode: str
    races: list[Race] = field(default_factory=list)
    unfollowed: list[str] = field(default_factory=list)  # one line each: what could not be followed, where
    notes: list[str] = field(default_factory=list)  # one line each: what was assumed (never a race)
    error: BaseException | None = None  # what the program itself raised
    error_text: str = ""  # its traceback, as Python would print it
    inside: str = ""  # what of the sanitizer's the program failed inside (never "on its own": inside_sanitizer)
    inside_status: int = 0  # the exit status that failure gives, with no race seen
    exit_status: int | None = None  # the program's own non-zero sys.exit status, if it ended so
    forced_timeouts: int = 0  # force mode: gates that opened by themselves (a window closed early)
    interrupted: bool = False  # Ctrl-C or SIGTERM stopped the program: the races are those seen before it


def prepare(mode: str) -> None:
    """What a run needs set before CUDA starts: in force mode every kernel module is loaded up front,
    since loading one lazily waits for the GPU to drain, which a closed gate keeps from happening."""
    if mode == "force":
        os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")


def resolve_backend(choice: str) -> str:
    """``auto`` is ``cuda`` on a machine with a GPU and ``sim`` elsewhere (as the runtime's
    :func:`kvdevice.runtime.resolve_backend`; the errors are the command's)."""
    if choice not in BACKENDS:
        raise UsageError(f"backend {choice!r} is not one of {', '.join(BACKENDS)}")
    if choice == "cuda" and not torch.cuda.is_available():
        raise UsageError("backend 'cuda' needs a GPU and torch with CUDA, and this machine has none; "
                         "use --backend sim to run the program's cuda work on the simulator")
    return runtime_backend(choice)


class GpuSanitizer:
    """The observer on a GPU, started and stopped around whatever runs in between."""

    def __init__(self, mode: str = "observe") -> None:
        from sanitizer.gpu.forcing import Forcing
        from sanitizer.gpu.observer import Observer

        if mode not in MODES:
            raise UsageError(f"mode {mode!r} is not one of {', '.join(MODES)}")
        self.mode = mode
        self.observer = Observer(forcing=Forcing() if mode == "force" else None)

    def start(self) -> None:
        self.observer.start()

    def checkpoint(self, failed: bool = False) -> tuple[list[Race], list[str], list[str]]:
        """End of a scope (a test phase): forced holds released, host checked; what it found
        (``failed``: the scope's code failed, which in force mode may show an unseen host read)."""
        return self._found(failed, stop=False)

    def stop(self, failed: bool = False) -> tuple[list[Race], list[str], list[str]]:
        return self._found(failed, stop=True)

    def _found(self, failed: bool, *, stop: bool) -> tuple[list[Race], list[str], list[str]]:
        from sanitizer.sites import caller_site

        obs = self.observer
        # The device-to-host copies force mode still holds as the scope's code failed (taken before
        # the scope's end releases them).
        held = obs.forcing.held_writes() if failed and obs.forcing is not None else []
        if stop:
            races = obs.stop()
        else:
            obs.scope_end(caller_site())
            races = obs.take_races()
        if held and not races:  # a race seen explains the failure already
            races = unseen_reads(held, races)
        return races, [u.message() for u in obs.take_unfollowed()], obs.take_notes()

    @property
    def timeouts(self) -> int:
        forcing = self.observer.forcing
        return forcing.timeouts if forcing is not None else 0


def unseen_reads(held: list[tuple[Any, Any]], seen: list[Race]) -> list[Race]:
    """The host reads force mode made visible only by the program's failure (module docstring):
    one race per device-to-host copy still held when it failed whose buffer no seen race names."""
    named = {race.resource for race in seen if race.kind == "host-read-vs-pending-copy"}
    found: list[Race] = []
    for region, access in held:
        if region.name in named:
            continue
        named.add(region.name)
        later = Access("a host read the sanitizer could not see as it happened (not through a torch op, "
                       ".tolist() or the buffer's numpy view), shown by the program's failure after force mode "
                       "held the copy open", "the host", None)
        found.append(Race("host-read-vs-pending-copy", region.name, region.site, access, later))
    return found


def sanitize(program: Callable[[], Any], *, backend: str = "auto", mode: str = "observe",
             name: str = "program") -> Outcome:
    """Run ``program`` under the sanitizer; its :class:`Outcome`."""
    backend = resolve_backend(backend)
    if mode not in MODES:
        raise UsageError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    outcome = Outcome(backend, mode)
    if backend == "sim":
        from sanitizer.sim.session import simulate

        outcome.races, error, outcome.notes, outcome.unfollowed = simulate(program, name)
        _settle(outcome, error)
        return outcome
    sanitizer = GpuSanitizer(mode)
    sanitizer.start()
    error: BaseException | None = None
    try:
        program()
    except (Exception, KeyboardInterrupt, SystemExit) as raised:  # noqa: BLE001 - reported beside its races
        error = raised
    finally:
        failed = error is not None and not isinstance(error, KeyboardInterrupt) and not _clean_exit(error)
        outcome.races, outcome.unfollowed, outcome.notes = sanitizer.stop(failed=failed)
        outcome.forced_timeouts = sanitizer.timeouts
    _settle(outcome, error)
    return outcome


def _clean_exit(error: BaseException) -> bool:
    return isinstance(error, SystemExit) and error.code in (None, 0)


def _settle(outcome: Outcome, error: BaseException | None) -> None:
    """What the program raised, as the outcome says it: an interruption, its own exit status, or a
    failure with its traceback."""
    if error is None or _clean_exit(error):
        return
    if isinstance(error, KeyboardInterrupt):
        outcome.interrupted = True
        return
    if isinstance(error, SystemExit):
        code = error.code
        outcome.exit_status = code if isinstance(code, int) else 1
        outcome.error = error
        outcome.error_text = "" if isinstance(code, int) else f"{code}\n"
        return
    outcome.error = error
    outcome.error_text = program_traceback(error)
    inside = inside_sanitizer(error)
    if inside is not None:
        outcome.inside, outcome.inside_status = inside


def inside_sanitizer(error: BaseException) -> tuple[str, int] | None:
    """What of the sanitizer's the program's failure ``error`` was raised inside, and the exit status
    it gives: a stand-in or an effect model (:func:`racecheck.custom_ops.failed_inside`: 3, a gap of
    ours, or 2 where it refused and said what to do: the op's extension is needed), or a patch of
    the sanitizer or the simulator, code of ours that does not hand the program's own call on
    (:func:`kvdevice.origin.blame`: 2 for a refusal that names its fix, else 3). None where the
    program failed on its own."""
    inside = failed_inside(error)
    if inside is not None:  # a refusal that names its fix (its extension is needed) is the user's to act on
        return inside, USAGE if getattr(error, "user_fixable", False) else INTERNAL
    frame = _innermost_of_ours(error)
    if frame is None:
        return None
    verdict = blame(error)
    if not verdict.harness:
        return None
    return f"kvz-sanitize's own code at {describe_frame(*frame)}", verdict.status or INTERNAL


def _innermost_of_ours(error: BaseException) -> tuple[Any, int] | None:
    """The innermost frame of this project's code in ``error``'s traceback that is not one of the
    frames that ran the program (those :func:`program_traceback` leaves out)."""
    frames = list(traceback.walk_tb(error.__traceback__))
    start = next((i for i, (frame, _) in enumerate(frames) if not _ours(frame.f_code.co_filename)), len(frames))
    ours = [(frame, line) for frame, line in frames[start:]
            if str(frame.f_globals.get("__name__", "")).split(".")[0] in HARNESS_MODULES]
    return ours[-1] if ours else None


def program_traceback(error: BaseException) -> str:
    """``error``'s traceback as Python would print it for the program, without the frames of the
    sanitizer that ran it (they are not the program's)."""
    tb = error.__traceback__
    while tb is not None and _ours(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(error), error, tb))


def _ours(filename: str) -> bool:
    resolved = os.path.abspath(filename)
    if resolved.startswith(_PROGRAMS):
        return False  # the benchmark's programs are programs
    return resolved.startswith(_OWN) or os.path.basename(resolved) == "runpy.py" or filename == "<frozen runpy>"


_OWN = os.path.dirname(os.path.abspath(__file__)) + os.sep
_PROGRAMS = _OWN + "bench" + os.sep
