"""``python -m sanitizer [options] -- python my_script.py [args]``: sanitize a program.

The program runs in this process, under the sanitizer (``python -m MODULE`` works too), and then
every distinct race is printed once, with how often it happened. Exit status (racecheck/cli.py): 0 no
race, 1 a race, 2 a usage error, a program that failed on its own with no race, or something the
sanitizer cannot follow, 3 a bug of the sanitizer (a program that failed inside one of the
sanitizer's stand-ins, models or patches, which the line names, is never said to have failed on its
own). Interrupted (Ctrl-C, SIGTERM), it prints the races seen so far and exits 1, or exits 130 when
it had seen none; ``--json`` is written only by a whole run.

Example::

    python -m sanitizer -- python engine_step.py --steps 100
    python -m sanitizer --force --json races.json -- python -m my_engine.bench
"""

from __future__ import annotations

import argparse
import contextlib
import os
import runpy
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import racecheck.interrupts as interrupts
from kvdevice.intercept.errors import in_tool_words
from kvdevice.origin import blame
from racecheck.atomic_file import write_json_atomically
from racecheck.cli import CLEAN, FINDING, INTERNAL, USAGE, ArgumentParser, UsageError, check_output, run_main
from sanitizer.gpu.forcing import HOLD_LIMIT_S
from sanitizer import numpy_views
from sanitizer.races import distinct
from sanitizer.sites import caller_site
from sanitizer.runner import BACKENDS, Outcome, prepare, sanitize

# What the user typed: the console script, or the module form (its --help and messages say the same).
GPU_WORDS = "a GPU instead (--backend cuda)"  # the way to the GPU, as this command spells it
PROG = "kvzero-sanitize" if os.path.basename(sys.argv[0]) == "kvzero-sanitize" else "python -m sanitizer"


def _program(command: list[str]) -> tuple[str, str, list[str]]:
    """(``"path"`` or ``"module"``, target, argv) from ``python SCRIPT ...`` / ``python -m MOD ...``."""
    if command and command[0] == "--":
        command = command[1:]
    if command and Path(command[0]).name.startswith("python"):
        command = command[1:]
    if not command:
        raise UsageError("no program given; e.g. python -m sanitizer -- python my_script.py")
    if command[0] == "-m":
        if len(command) < 2:
            raise UsageError("-m needs a module name; e.g. python -m sanitizer -- python -m my_pkg.bench")
        return "module", command[1], command[1:]
    if command[0].startswith("-"):
        raise UsageError(f"python option {command[0]!r} is not supported here; give a script path or -m MODULE")
    script = Path(command[0])
    if not script.is_file():
        raise UsageError(f"program {command[0]!r} is not a file; give the path of a Python script, "
                         f"e.g. python -m sanitizer -- python my_script.py")
    return "path", str(script), command


def _run(kind: str, target: str, argv: list[str]) -> None:
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = argv
    sys.path.insert(0, str(Path(target).resolve().parent) if kind == "path" else os.getcwd())
    try:  # a SystemExit of the program's own is the runner's to judge (sanitizer.runner)
        if kind == "path":
            runpy.run_path(target, run_name="__main__")
        else:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
    finally:
        sys.argv, sys.path = saved_argv, saved_path


def describe(outcome: Outcome, *, forced: bool = False) -> str:
    """The run's backend and mode as the summary line says them."""
    if outcome.backend == "cuda":
        return f"{outcome.mode} mode, cuda"
    if forced:
        return "simulator, which holds every copy until the host synchronises, as --force does on a GPU"
    return "simulator"


def report(outcome: Outcome, name: str, *, partial: bool, forced: bool = False, out: object = None) -> int:
    out = out or sys.stdout
    groups = distinct(outcome.races)
    for first, members in groups:
        print(first.format(), file=out)
        if len(members) > 1:
            print(f"  seen:    {len(members)} times in this run", file=out)
        print(file=out)
    for line in outcome.notes:
        print(line, file=out)
    for line in outcome.unfollowed:
        print(f"{line}{'' if partial else '; rerun with --partial to check the rest of the program'}", file=out)
    mode = describe(outcome, forced=forced)
    if outcome.forced_timeouts:
        print(f"kvz-sanitize: force mode opened its gates by the {HOLD_LIMIT_S:g} s limit {outcome.forced_timeouts} "
              f"time(s) (the host waited for the GPU where no hook shows it): the values of those copies were "
              f"not compared", file=out)
    if groups:
        print(f"kvz-sanitize: {len(groups)} distinct race{'s' if len(groups) != 1 else ''} "
              f"({len(outcome.races)} seen) in {name} [{mode}]", file=out)
    refused = outcome.error is not None and outcome.inside and outcome.inside_status == USAGE and not groups
    if refused:  # a refusal that names its fix: one line, the program's line and ours, no traceback
        where = blame(outcome.error).where
        print(f"kvz-sanitize cannot run {where or name} [{mode}]: {in_tool_words(outcome.error, GPU_WORDS)}",
              file=sys.stderr)
        return USAGE
    if outcome.error is not None:
        print(outcome.error_text, file=sys.stderr, end="")
        ended = (f"exited with status {outcome.exit_status}" if outcome.exit_status is not None
                 else f"failed ({type(outcome.error).__name__})")
        if outcome.inside:  # a stand-in, model or patch of ours it met: never the program's own failure
            ended += f" inside {outcome.inside}, not on its own"
        if groups:
            print(f"kvz-sanitize: {name} {ended} after the race{'s' if len(groups) != 1 else ''} above", file=out)
        elif outcome.inside:
            bug = "; a bug of kvz-sanitize, not of the program: please report this line" \
                if outcome.inside_status == INTERNAL else ""
            print(f"kvz-sanitize: {name} {ended}, with no race seen [{mode}]{bug}", file=sys.stderr)
            return outcome.inside_status
        else:
            print(f"kvz-sanitize: {name} {ended} on its own with no race seen [{mode}]", file=sys.stderr)
            return USAGE
    if groups:
        return FINDING
    if outcome.unfollowed and not partial:
        return USAGE
    print(f"kvz-sanitize: no race in {name} [{mode}]", file=out)
    return CLEAN


def _print_races(races: list) -> list:
    """Print each distinct race of a run that ends early (stdout flushed); the groups."""
    groups = distinct(races)
    for first, _members in groups:
        print(first.format(), file=sys.stdout)
        print(file=sys.stdout)
    sys.stdout.flush()
    return groups


def _forced_end() -> int:
    """A run still stuck after Ctrl-C or SIGTERM is ended by force (racecheck.interrupts): the races
    the GPU observer had seen are printed first, and the status is the interrupted run's."""
    from sanitizer.gpu.observer import races_so_far

    groups = _print_races(races_so_far())
    print(f"{PROG}: interrupted, and ended by force; "
          + ("the races above were seen before it" if groups else "no race seen before it"), file=sys.stderr)
    return FINDING if groups else 130


@contextlib.contextmanager
def _reported_on_hard_exit(name: str, json_path: Path | None) -> Iterator[None]:
    """While the program runs, ``os._exit(code)`` (no ``finally``, no ``atexit``: the way a program
    skips a slow shutdown) first reports the races seen so far, each checker's last checks made, and
    exits with the command's status for them: 1 for races, else 0, or 2 for a non-zero code of the
    program's own. A forked child's ``os._exit`` is its own."""
    real_exit, parent = os._exit, os.getpid()

    def hard_exit(code: int) -> NoReturn:
        if os.getpid() != parent:
            real_exit(code)
        site = caller_site()
        races = []
        for watch in numpy_views.watches():  # every running checker's watch, innermost last
            watch.scope_end(site)
            races.extend(watch.races)
        groups = _print_races(races)
        said = "the races above were seen before it" if groups else "no race seen before it"
        print(f"{PROG}: {name} ended with os._exit({code}) at {site.short}; {said}"
              f"{' (--json not written)' if json_path is not None else ''}", file=sys.stderr)
        sys.stderr.flush()
        real_exit(FINDING if groups else CLEAN if code == 0 else USAGE)

    os._exit = hard_exit
    try:
        yield
    finally:
        os._exit = real_exit


def _main(argv: list[str]) -> int:
    interrupts.install()  # SIGTERM stops the program as Ctrl-C does
    interrupts.set_forced_status(_forced_end)
    p = ArgumentParser(prog=PROG, description="Run a Python program under the race sanitizer for GPU memory traffic "
                                                   "(pinned memory, streams, threads, CUDA graphs).")
    p.add_argument("--force", action="store_true",
                   help="hold queued copies to and from pinned memory until the host next synchronises, so a race "
                        "also shows as wrong values (on the simulator every run already does: accepted, changes nothing)")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="cuda: the observer on this machine's GPU; sim: the program's cuda work on the CPU "
                        "simulator; auto (default): cuda when there is a GPU")
    p.add_argument("--partial", action="store_true",
                   help="report what cannot be followed (a CUDA graph replay) as a note, not an error")
    p.add_argument("--json", metavar="PATH", help="also write the races as JSON to PATH")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- python SCRIPT [ARGS] or -- python -m MODULE [ARGS]")
    args = p.parse_args(argv)
    json_path = check_output("--json", args.json)
    kind, target, program_argv = _program(args.command)
    mode = "force" if args.force else "observe"
    prepare(mode)
    with _reported_on_hard_exit(target, json_path):
        outcome = sanitize(lambda: _run(kind, target, program_argv), backend=args.backend, mode=mode, name=target)
    if outcome.interrupted:
        # Nothing seen is lost, and no result file is written from a run cut short (it could
        # replace a complete one): the races so far go to the terminal, then the interruption.
        if not outcome.races:
            raise KeyboardInterrupt
        report(outcome, target, partial=args.partial, forced=args.force)
        print(f"{PROG}: interrupted; the races above were seen before it"
              f"{' (--json not written)' if json_path is not None else ''}", file=sys.stderr)
        return FINDING
    if json_path is not None:
        data = {"program": target, "backend": outcome.backend, "mode": outcome.mode,
                "races": [r.to_json() for r in outcome.races], "unfollowed": outcome.unfollowed,
                "notes": outcome.notes, "program_exit_status": outcome.exit_status,
                "forced_timeouts": outcome.forced_timeouts,
                "program_error": repr(outcome.error) if outcome.error is not None else None,
                "program_failed_inside": outcome.inside or None}
        write_json_atomically(json_path, data)
    return report(outcome, target, partial=args.partial, forced=args.force)


def main(argv: list[str] | None = None) -> int:
    return run_main(_main, argv, PROG)


if __name__ == "__main__":
    sys.exit(main())
