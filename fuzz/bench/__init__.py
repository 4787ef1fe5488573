"""Benchmarks, each with its command line, report and plots:

* ``python -m fuzz.bench.detect``: what the fuzzer finds in the bug zoo, against three baselines;
* ``python -m fuzz.bench.speed``: fuzzer throughput and time to a finding;
* ``python -m fuzz.bench.kernel``: the zero kernel's bandwidth and each design's host cost;
  ``python -m fuzz.bench.kernel.scatter``: what limits it on scattered pages;
* ``python -m fuzz.bench.selfcheck``: every self-check campaign over many seeds.

What their commands share: :func:`command` makes a ``main(argv)`` the entry point, and
:func:`positive_int` reads a count given on the command line, and a bad one is a :class:`BenchUsageError`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from racecheck.cli import UsageError, run_main


def command(prog: str) -> Callable[[Callable[[list[str]], int]], Callable[..., int]]:
    """``@command(PROG)`` over ``main(argv)``: the entry point ``main(argv=None)`` (None: ``sys.argv[1:]``),
    run under :func:`racecheck.cli.run_main`, which turns errors into its exit statuses and one-line messages."""

    def entry(main: Callable[[list[str]], int]) -> Callable[..., int]:
        return functools.wraps(main)(lambda argv=None: run_main(main, argv, prog))

    return entry


class BenchUsageError(UsageError, ValueError):
    """A bad command line or argument; the message names the value and the fix (exit status 2)."""


def positive_int(flag: str, text: str, example: str) -> int:
    """``text`` as an int of 1 or more, else ``BenchUsageError('FLAG 'TEXT' must be a positive integer, e.g. EXAMPLE')``."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise BenchUsageError(f"{flag} {text!r} must be a positive integer, e.g. {example}")
    return value
