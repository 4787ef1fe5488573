"""One exit-status convention for every command of this project, and the wrapper that keeps it.

Every command of both tools (``python -m repro``, ``python -m fuzz.bench.*``, ``python -m
sanitizer``; the pytest plugins keep the same numbers through ``pytest.exit``) exits

* :data:`CLEAN` (0): clean, or not reproduced;
* :data:`FINDING` (1): a finding, or reproduced (a missed self-check, a false positive);
* :data:`USAGE` (2): a bad option or input file: ONE line on stderr that names the value and the
  fix, never a traceback;
* :data:`INTERNAL` (3): an unexpected exception, which is a bug in this tool: one line that says
  so, with the exception, and how to see the traceback.

:func:`run_main` maps exceptions to those statuses: a :class:`UsageError` (which ``TraceError``,
``RegenerateError`` and ``fuzz.bench.BenchUsageError`` are) or a
:class:`racecheck.errors.KvzeroError` (``zeroer.errors.ZeroerError``: an unknown geometry, zeroer
spec or backend) is a usage error; the GPU out of memory or out of hardware queues
(:mod:`racecheck.resources`) is one too, the user's to free; an error type a tool registered with
:func:`register_exit_status` gets the status and the line it says (the fuzzer's
``HarnessError``: the harness could not follow or run the code, 2 or 3); any other exception is
internal. ``--debug`` anywhere on the command line also prints the
traceback (the status stays the same). :class:`ArgumentParser` is argparse's, with its errors on
one line (``PROG: error: MESSAGE``, argparse's own status 2) and ``--debug`` in its ``--help``.
The table of bad inputs and what each prints: docs/bad-input.md.

Example::

    def main(argv: list[str] | None = None) -> int:
        return run_main(_main, argv, "python -m fuzz.bench.speed")

    def _main(argv: list[str]) -> int:
        args = parser().parse_args(argv)
        check_output("--json", args.json)            # before the work, not after it
        ...
        return FINDING if missed else CLEAN
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from racecheck.errors import KvzeroError

CLEAN = 0
FINDING = 1
USAGE = 2
INTERNAL = 3
INTERRUPTED = 130  # Ctrl-C: the shell's 128 + SIGINT, one line instead of a traceback
DEBUG_FLAG = "--debug"


class UsageError(Exception):
    """A bad option or input file; the message names the value and the fix (exit status 2)."""


USAGE_ERRORS: tuple[type[Exception], ...] = (UsageError, KvzeroError)

# error type -> (the error, the command's name) -> (exit status, the one line, what --debug prints instead
# of the traceback or None): what a tool registered for its own errors (register_exit_status).
_REGISTERED: list[tuple[type[BaseException], Callable[[BaseException, str], tuple[int, str, str | None]]]] = []


def register_exit_status(error_type: type[BaseException],
                         report: Callable[[BaseException, str], tuple[int, str, str | None]]) -> None:
    """Errors of ``error_type`` end a command with ``report(error, prog)``: (exit status, the line
    to print, what ``--debug`` prints instead of the traceback, or None). A tool registers its own
    errors where it defines them; the first registration of a type that matches wins."""
    if all(registered is not error_type for registered, _ in _REGISTERED):
        _REGISTERED.append((error_type, report))


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with a one-line error (no usage block) and ``--debug`` in its help.

    Subparsers made by :meth:`add_subparsers` are of this class too. ``--debug`` itself is taken
    off the command line by :func:`run_main` before parsing.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.add_argument(DEBUG_FLAG, action="store_true", help="on an error, also print its traceback")

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE, f"{self.prog}: error: {one_line(message)}\n")


def positive(kind: type, what: str, example: str) -> Callable[[str], float]:
    """An argparse ``type=``: a finite number greater than 0 of ``kind`` (int or float), or the
    error ``'TEXT' is not a positive number of WHAT, e.g. EXAMPLE``."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            value = -1
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of {what}, e.g. {example}")
        return value

    return parse


def one_line(text: object) -> str:
    """``text`` with its line breaks folded, so a message is one line of a terminal or a log."""
    return " ".join(str(text).split())


def usage_message(error: BaseException) -> str:
    return f"error: {one_line(error)}"


def internal_message(prog: str, error: BaseException) -> str:
    return (f"{prog}: internal error, a bug in kvzero-fuzz: {type(error).__name__}: {one_line(error)} "
            f"(rerun with {DEBUG_FLAG} for the traceback and report it)")


def run_main(main: Callable[[list[str]], int], argv: Sequence[str] | None, prog: str) -> int:
    """Run ``main(argv)`` under the convention; returns its exit status.

    ``argv`` None means ``sys.argv[1:]``. argparse's own exits (``--help``, a syntax error) pass
    through as ``SystemExit``, as they always have.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    end = argv.index("--") if "--" in argv else len(argv)
    debug = DEBUG_FLAG in argv[:end]
    if debug:
        argv = [a for i, a in enumerate(argv) if not (a == DEBUG_FLAG and i < end)]
    from racecheck.resources import ResourceExhausted, out_of_memory_message

    try:
        return main(argv)
    except USAGE_ERRORS as error:
        return _report(usage_message(error), USAGE, debug)
    except ResourceExhausted as error:  # the GPU out of memory: no verdict, and the user's to free (racecheck.resources)
        return _report(f"{prog}: {one_line(error)}", USAGE, debug)
    except KeyboardInterrupt:
        return _report(f"{prog}: interrupted", INTERRUPTED, debug)
    except BaseException as error:  # noqa: BLE001 - the point: a bug says so in one line, not a traceback
        for error_type, report in _REGISTERED:
            if isinstance(error, error_type):  # a tool's own error: its status and its line
                status, line, details = report(error, prog)
                if debug and details is not None:
                    print(details, file=sys.stderr, end="")
                return _report(line, status, debug and details is None)
        if not isinstance(error, Exception):
            raise  # SystemExit and the like pass through, as they always have
        if _out_of_gpu_resources(error):  # a CUDA resource ran out under our own work: the user's to free
            return _report(f"{prog}: {out_of_memory_message(error)}", USAGE, debug)
        return _report(internal_message(prog, error), INTERNAL, debug)


def _out_of_gpu_resources(error: BaseException) -> bool:
    try:
        from racecheck.resources import is_out_of_memory

        return is_out_of_memory(error)
    except ImportError:  # no torch: no GPU to run out of
        return False


def _report(line: str, status: int, debug: bool) -> int:
    if debug:
        traceback.print_exc()
    print(line, file=sys.stderr, flush=True)
    return status


def check_output(flag: str, path: Path | str | None, what: str = "file path") -> Path | None:
    """Before any work: ``path`` (a ``"file path"`` or a ``"directory"``) can be written.

    Creates the directory (or the file's) as the run would; a path that cannot be written is a
    :class:`UsageError` naming the flag. None (the option was not given) passes.
    """
    if path is None:
        return None
    path = Path(path)
    if what != "directory" and path.is_dir():
        raise UsageError(f"{flag} {str(path)!r} is a directory; give a file path, e.g. {path / 'out.json'}")
    directory = path if what == "directory" else path.parent
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"{flag} {str(path)!r}: {str(directory)!r} is a file, not a directory; "
                         f"give a {what} you can write to")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".kvzero-write-check-"):
            pass
    except OSError as error:
        raise UsageError(f"{flag} {str(path)!r}: cannot write there ({error.strerror or error}); "
                         f"give a {what} you can write to") from None
    return path
