"""The sanitizer benchmark's programs (sanitizer/bench/programs) under the sanitizer, on the
simulator: the CI half of the benchmark (issue 24). Every racy program must be reported with its
planted kind and both program lines; every race-free twin must be clean and pass its own check.
On the simulator queued work runs only when the host synchronises, so a racy program may also fail
its own value check: that is the race showing.

The same programs on a GPU, under PyTorch's sanitizer and ours: tests/test_sanitizer_gpu.py and
``python -m sanitizer.bench.compare`` (docs/sanitizer.md has the table).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sanitizer.bench import engine_loop
from sanitizer.bench.programs import (BY_NAME, DEVICE_ACCESS, ENGINE_ZEROERS, HOST_WRITE, PROGRAMS, ZEROERS,
                                           Program, load, path, zeroer_spec)
from sanitizer.runner import sanitize

STEPS = 8
DEVICE_KINDS = {DEVICE_ACCESS, "reuse-without-record-stream"}


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: p.name)
def test_the_sanitizer_on_the_simulator_judges_each_program_rightly(program: Program) -> None:
    outcome = sanitize(lambda: load(program.name).main(steps=STEPS), backend="sim", name=program.name)
    kinds = sorted({r.kind for r in outcome.races})
    if not program.racy:
        assert not outcome.races, f"race-free {program.name}: " + "\n".join(r.format() for r in outcome.races)
        assert outcome.error is None, f"race-free {program.name} failed its own check: {outcome.error}"
        return
    wanted = {program.hazard} if program.hazard == HOST_WRITE else DEVICE_KINDS
    assert wanted & set(kinds), f"racy {program.name} ({program.hazard}): got {kinds or 'nothing'}"
    source = Path(path(program.name)).name
    race = next(r for r in outcome.races if r.kind in wanted)
    assert race.queued.site is not None and race.queued.site.file.endswith(source), race.format()
    assert race.later.site is not None and race.later.site.file.endswith(source), race.format()


@pytest.mark.parametrize("program", ZEROERS, ids=lambda p: p.name)
def test_the_fuzz_campaigns_zeroers_in_a_plain_engine_loop_get_their_verdicts(program: Program) -> None:
    spec = zeroer_spec(program)
    outcome = sanitize(lambda: engine_loop.main(spec, steps=24), backend="sim", name=program.name)
    if not program.racy:
        assert not outcome.races, f"race-free {spec}: " + "\n".join(r.format() for r in outcome.races)
        assert outcome.error is None, f"race-free {spec} failed the loop's check: {outcome.error}"
        return
    wanted = {program.hazard} if program.hazard == HOST_WRITE else DEVICE_KINDS
    kinds = {r.kind for r in outcome.races}
    assert wanted & kinds, f"racy {spec} ({program.hazard}): got {sorted(kinds) or 'nothing'}"
    race = next(r for r in outcome.races if r.kind in wanted)
    assert race.queued.site is not None and race.queued.site.file.endswith(ENGINE_ZEROERS.name), race.format()


def test_the_registry_pairs_each_racy_program_with_a_race_free_twin() -> None:
    assert len(BY_NAME) == len(PROGRAMS), "duplicate program names"
    for program in PROGRAMS:
        twin = BY_NAME[program.twin]
        assert twin.twin == program.name and twin.racy != program.racy, f"{program.name} <-> {twin.name}"
        assert twin.pattern == program.pattern
        assert program.hazard in ((HOST_WRITE, DEVICE_ACCESS) if program.racy else ("",))
        module = load(program.name)
        assert path(program.name) == Path(module.__file__)
        assert module.__doc__ and callable(module.main)
        assert ("RACY" in module.__doc__.splitlines()[0]) == program.racy
