"""Whether a report on a benchmark program is right: the planted race, by its kind and both lines.

A racy program marks the two lines of its race (``# race: queued``, ``# race: later``;
:func:`sanitizer.bench.programs.marked_lines`). A report *found* it when one of its races has the
planted kind, its queued op on the queued line and its later access on the later line, both in the
program's file. Races of the right kind at other lines are *wrong lines*, races of other kinds only
*wrong kind*: both count as missed, never as found. A race-free twin is *clean* when nothing is
reported and a *false alarm* otherwise. The ``zeroer:`` rows drive a zeroer of
``examples/engine_zeroers.py``, whose file holds racy and race-free factories side by side: there
the queued op must be in that file, with the planted kind.

Example::

    judge(program, races)      # "found", "wrong lines", "wrong kind", "missed", "clean" or "false alarm"
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sanitizer.bench.programs import ENGINE_ZEROERS, Program, marked_lines, source

FOUND, MISSED, WRONG_KIND, WRONG_LINES, CLEAN, FALSE_ALARM = (
    "found", "missed", "wrong kind", "wrong lines", "clean", "false alarm")


def _site(access: dict[str, Any]) -> tuple[str, int] | None:
    site = access.get("site")
    return (site["file"], int(site["line"])) if site else None


def judge(program: Program, races: list[dict[str, Any]]) -> str:
    """The verdict on ``races`` (as ``Race.to_json`` gives them) for ``program`` (module docstring)."""
    if not program.racy:
        return FALSE_ALARM if races else CLEAN
    if not races:
        return MISSED
    kinds = [r for r in races if r["kind"] == program.hazard]
    if not kinds:
        return WRONG_KIND
    if program.name.startswith("zeroer:"):
        return FOUND if any(_in(_site(r["queued"]), ENGINE_ZEROERS) for r in kinds) else WRONG_LINES
    path = source(program)
    lines = marked_lines(path)
    for race in kinds:
        queued, later = _site(race["queued"]), _site(race["later"])
        if queued and later and _in(queued, path) and _in(later, path) \
                and queued[1] == lines["queued"] and later[1] == lines["later"]:
            return FOUND
    return WRONG_LINES


def _in(site: tuple[str, int] | None, path: Path) -> bool:
    return site is not None and Path(site[0]).name == path.name and (
        not Path(site[0]).is_absolute() or Path(site[0]).resolve() == path.resolve()
        or Path(site[0]).name == path.name)
