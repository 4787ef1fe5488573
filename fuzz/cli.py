"""The exit-status convention and command wrapper, as the fuzzer's scripts import them.

Both tools share them from :mod:`racecheck.cli`; this name stays for the standalone scripts
``python -m repro export`` writes (``from fuzz.cli import ArgumentParser, run_main``), so a script
exported before keeps running.
"""

from __future__ import annotations

from racecheck.cli import (CLEAN, FINDING, INTERNAL, INTERRUPTED, USAGE, USAGE_ERRORS, ArgumentParser, UsageError,
                           check_output, one_line, positive, register_exit_status, run_main)

__all__ = ["CLEAN", "FINDING", "INTERNAL", "INTERRUPTED", "USAGE", "USAGE_ERRORS", "ArgumentParser", "UsageError",
           "check_output", "one_line", "positive", "register_exit_status", "run_main"]
