"""Whether a report on a benchmark program is right: the planted race, by its kind and both lines.

A racy program marks the two lines of its race (``# race: queued``, ``# race: later``;
:func:`sanitizer.bench.programs.marked_lines`). A report *found* it when one of its races has the
planted kind, its queued op on the queued line and its later access on the later line, both in the
program's file. Races of the right kind at other lines (or in another file) are *wrong lines*,
races of other kinds only *wrong kind*: both count as missed, never as found. A race-free twin is
*clean* when nothing is reported and a *false alarm* otherwise. The ``zeroer:`` rows drive a zeroer
of ``examples/engine_zeroers.py``, whose file holds racy and race-free factories side by side: there
each racy factory marks its two lines with its name (``# race[single_pinned_buffer]: queued``), and
the rule is the same.

A report's file is the program's file when both name the same file on disk: a report names it
relative to the working directory of the run (:mod:`sanitizer.sites`), which is the judge's own
(the benchmark runs each program from where it judges it), or by its absolute path. A file of the
same name elsewhere is another file.

Example::

    judge(program, races)      # "found", "wrong lines", "wrong kind", "missed", "clean" or "false alarm"
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sanitizer.bench.programs import Program, race_lines, source

FOUND, MISSED, WRONG_KIND, WRONG_LINES, CLEAN, FALSE_ALARM = (
    "found", "missed", "wrong kind", "wrong lines", "clean", "false alarm")


def _site(access: dict[str, Any]) -> tuple[str, int] | None:
    site = access.get("site")
    return (site["file"], int(site["line"])) if site else None


def judge(program: Program, races: list[dict[str, Any]]) -> str:
    """The verdict on ``races`` (as ``Race.to_json`` gives them) for ``program`` (module docstring)."""
    if not program.racy:
        return FALSE_ALARM if races else CLEAN
    marks = {which: (source(program), line) for which, line in race_lines(program).items()} if races else {}
    return judge_lines(program.hazard, marks, races)


def judge_lines(hazard: str, marks: dict[str, tuple[Path, int]], races: list[dict[str, Any]]) -> str:
    """The verdict on ``races`` for a racy program whose race is of kind ``hazard`` at ``marks``
    (``{"queued": (file, line), "later": (file, line)}``; a unit test may mark its queued line in the
    test and its later one in the code under test): the rule of :func:`judge`, for programs outside
    the benchmark's own collections."""
    if not races:
        return MISSED
    kinds = [r for r in races if r["kind"] == hazard]
    if not kinds:
        return WRONG_KIND
    for race in kinds:
        if _at(_site(race["queued"]), *marks["queued"]) and _at(_site(race["later"]), *marks["later"]):
            return FOUND
    return WRONG_LINES


def _at(site: tuple[str, int] | None, path: Path, line: int) -> bool:
    """Whether ``site`` is ``line`` of the file ``path``."""
    return site is not None and site[1] == line and _same_file(site[0], path)


def _same_file(reported: str, path: Path) -> bool:
    try:
        return os.path.samefile(reported, path)  # relative names are relative to the working directory
    except OSError:  # no such file here: compare the names as paths
        return Path(reported).resolve() == path.resolve()
