"""One exit-status convention for every command of this project, and the wrapper that keeps it.

Every command (``python -m repro``, ``python -m fuzz.bench.*``; the pytest plugin keeps the same
numbers through ``pytest.exit``) exits

* :data:`CLEAN` (0): clean, or not reproduced;
* :data:`FINDING` (1): a finding, or reproduced (a missed self-check, a false positive);
* :data:`USAGE` (2): a bad option or input file: ONE line on stderr that names the value and the
  fix, never a traceback;
* :data:`INTERNAL` (3): an unexpected exception, which is a bug in this tool: one line that says
  so, with the exception, and how to see the traceback.

A :class:`fuzz.engine.harness_error.HarnessError` (the harness could not follow or run a zeroer)
prints its own one line and exits with its own status, 2 or 3.

:func:`run_main` maps exceptions to those statuses: a :class:`UsageError` (which ``TraceError``,
``RegenerateError``, ``DetectUsageError`` and ``BaselineUsageError`` are) or a
:class:`zeroer.errors.ZeroerError` (an unknown geometry, zeroer spec or backend) is a usage error;
any other exception is internal. ``--debug`` anywhere on the command line also prints the
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

from zeroer.errors import ZeroerError

CLEAN = 0
FINDING = 1
USAGE = 2
INTERNAL = 3
INTERRUPTED = 130  # Ctrl-C: the shell's 128 + SIGINT, one line instead of a traceback
DEBUG_FLAG = "--debug"


class UsageError(Exception):
    """A bad option or input file; the message names the value and the fix (exit status 2)."""


USAGE_ERRORS: tuple[type[Exception], ...] = (UsageError, ZeroerError)


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
    from fuzz.engine.harness_error import HarnessError  # one step down, imported when a command runs
    from fuzz.engine.resources import ResourceExhausted

    try:
        return main(argv)
    except USAGE_ERRORS as error:
        return _report(usage_message(error), USAGE, debug)
    except HarnessError as error:  # the harness could not follow or run the zeroer: its own one line and status
        if debug:
            print(error.details, file=sys.stderr, end="")
        return _report(f"{prog}: {error.message}", error.status, False)
    except ResourceExhausted as error:  # the GPU out of memory: no verdict, and the user's to free (fuzz.engine.resources)
        return _report(f"{prog}: {one_line(error)}", USAGE, debug)
    except KeyboardInterrupt:
        return _report(f"{prog}: interrupted", INTERRUPTED, debug)
    except Exception as error:  # noqa: BLE001 - the point: a bug says so in one line, not a traceback
        if _out_of_gpu_resources(error):  # a CUDA resource ran out under our own work: the user's to free
            from fuzz.engine.resources import out_of_memory_message

            return _report(f"{prog}: {out_of_memory_message(error)}", USAGE, debug)
        return _report(internal_message(prog, error), INTERNAL, debug)


def _out_of_gpu_resources(error: BaseException) -> bool:
    try:
        from fuzz.engine.resources import is_out_of_memory

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
