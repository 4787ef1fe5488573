"""The sanitizer benchmark's programs on the simulator, judged strictly: the CI half of the benchmark.

Every racy program (the engine-like programs, the corpus of the engines' own races, and the fuzz
campaigns' vLLM-style zeroers in a plain engine loop) must be reported with its planted kind and
both of its marked lines (sanitizer/bench/verdict.py); every race-free twin must be clean and pass
its own check. On the simulator queued work runs only when the host synchronises, so a racy program
may also fail its own value check: that is the race showing.

The same programs on a GPU, under PyTorch's sanitizer and ours, with the corpus's ground truth by
forced sleeps: tests/test_sanitizer_gpu.py and ``python -m sanitizer.bench.compare`` (docs/sanitizer.md).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from zeroer import engine_loop
from sanitizer.bench.corpus import CORPUS
from sanitizer.bench.corpus import load as load_corpus
from sanitizer.bench.programs import (DEVICE_ACCESS, HOST_READ, HOST_WRITE, PROGRAMS, REUSE, ZEROERS,
                                      Program, load, marked_lines, race_lines, source, zeroer_spec)
from sanitizer.bench.verdict import CLEAN, FOUND, judge
from sanitizer.runner import sanitize

STEPS = 6


def _run(program: Program):
    if program.collection == "zeroer":
        spec = zeroer_spec(program)
        return sanitize(lambda: engine_loop.main(spec, steps=24), backend="sim", name=program.name)
    module = load(program.name) if program.collection == "programs" else load_corpus(program.name)
    return sanitize(lambda: module.main(steps=STEPS), backend="sim", name=program.name)


@pytest.mark.parametrize("program", PROGRAMS + CORPUS + ZEROERS, ids=lambda p: p.name)
def test_the_sanitizer_on_the_simulator_reports_the_planted_race_with_its_kind_and_both_lines(program: Program) -> None:
    outcome = _run(program)
    verdict = judge(program, [r.to_json() for r in outcome.races])
    report = "\n".join(r.format() for r in outcome.races) or "nothing"
    if program.racy:
        assert verdict == FOUND, f"{program.name} ({program.hazard}): {verdict}\n{report}"
    else:
        assert verdict == CLEAN, f"race-free {program.name}: {report}"
        assert outcome.error is None, f"race-free {program.name} failed its own check: {outcome.error_text}"
        assert not outcome.notes, outcome.notes


@pytest.mark.parametrize("registry", [PROGRAMS, CORPUS], ids=["programs", "corpus"])
def test_each_racy_program_has_a_race_free_twin_and_marks_its_two_lines(registry: tuple[Program, ...]) -> None:
    names = {p.name: p for p in registry}
    assert len(names) == len(registry), "duplicate program names"
    for program in registry:
        twin = names[program.twin]
        assert twin.twin == program.name and twin.racy != program.racy, f"{program.name} <-> {twin.name}"
        assert twin.pattern == program.pattern and twin.upstream == program.upstream
        assert program.hazard in ((HOST_WRITE, HOST_READ, DEVICE_ACCESS, REUSE) if program.racy else ("",))
        path = source(program)
        module = load(program.name) if program.collection == "programs" else load_corpus(program.name)
        assert Path(module.__file__) == path and module.__doc__ and callable(module.main)
        assert ("RACY" in module.__doc__.splitlines()[0]) == program.racy
        if program.racy:
            lines = marked_lines(path)
            assert lines["queued"] != lines["later"], program.name
        else:
            with pytest.raises(ValueError, match=r": no '# race: queued' marker"):
                marked_lines(path)


def test_every_corpus_program_is_a_row_of_the_docs_table_with_its_upstream_and_kind() -> None:
    """docs/sanitizer.md's results table is the corpus: each program a row, a racy one with its
    upstream bug and planted kind, a race-free twin "none (twin)", and no row that names no program."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "sanitizer.md").read_text()
    kinds = {p.hazard for p in CORPUS if p.racy} | {"none (twin)"}
    rows = {name: (upstream, kind) for name, upstream, kind in
            re.findall(r"^\| `(\w+)` \| ([^|]+) \| ([^|]+) \|", text, re.MULTILINE) if kind.strip() in kinds}
    for program in CORPUS:
        assert program.name in rows, f"{program.name} has no row in docs/sanitizer.md's results table"
        upstream, kind = (cell.strip() for cell in rows[program.name])
        assert kind == (program.hazard if program.racy else "none (twin)"), (program.name, kind)
        if program.racy:  # a twin's row may name the fix instead (vLLM #48399 fixed #48085)
            assert program.upstream.split(" (")[0] in upstream, (program.name, upstream)
    assert set(rows) <= {p.name for p in CORPUS}, set(rows) - {p.name for p in CORPUS}


def _race(program: Program, queued: tuple[str, int], later: tuple[str, int], kind: str = "") -> dict:
    def access(site: tuple[str, int]) -> dict:
        return {"site": {"file": site[0], "line": site[1], "function": "f"}}

    return {"kind": kind or program.hazard, "queued": access(queued), "later": access(later)}


@pytest.mark.parametrize("name", ["block_table_one_buffer", "zeroer:single_pinned_buffer",
                                  "zeroer:side_stream_copy_event_on_caller"])
def test_only_the_planted_kind_at_both_marked_lines_of_the_programs_own_file_is_a_find(
        name: str, tmp_path: Path) -> None:
    program = next(p for p in PROGRAMS + ZEROERS if p.name == name)
    path, lines = source(program), race_lines(program)
    queued, later = (str(path), lines["queued"]), (str(path), lines["later"])
    assert judge(program, [_race(program, queued, later)]) == FOUND
    relative = os.path.relpath(path)  # as a report names a file under the working directory
    assert judge(program, [_race(program, (relative, lines["queued"]), (relative, lines["later"]))]) == FOUND
    wrong_lines = {
        "queued line": _race(program, (str(path), lines["queued"] + 1), later),
        "later line": _race(program, queued, (str(path), lines["later"] + 1)),
        "lines swapped": _race(program, later, queued),
        "same name, other directory": _race(program, (str(tmp_path / path.name), lines["queued"]),
                                            (str(tmp_path / path.name), lines["later"])),
        "queued op in another file": _race(program, (str(engine_loop.__file__), lines["queued"]), later),
        "later access in another file": _race(program, queued, (str(engine_loop.__file__), lines["later"])),
    }
    for why, race in wrong_lines.items():
        assert judge(program, [race]) == "wrong lines", why
    other_kind = DEVICE_ACCESS if program.hazard != DEVICE_ACCESS else HOST_WRITE
    assert judge(program, [_race(program, queued, later, kind=other_kind)]) == "wrong kind"
    assert judge(program, [*wrong_lines.values(), _race(program, queued, later)]) == FOUND  # one right race is enough
    assert judge(program, []) == "missed"


def test_each_racy_zeroer_marks_its_two_lines_with_its_name_and_a_race_free_one_none() -> None:
    for program in ZEROERS:
        if program.racy:
            lines = race_lines(program)
            assert lines["queued"] != lines["later"], program.name
        else:
            factory = program.name.removeprefix("zeroer:")
            with pytest.raises(ValueError, match=rf": no 'race\[{factory}\]: queued' marker; no 'race\[{factory}\]: later' marker$"):
                race_lines(program)
