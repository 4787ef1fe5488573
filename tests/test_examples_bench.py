"""``python -m fuzz.bench.examples``: every campaign of a file of factories, findings replayed, race-free ones soaked.

The real subject is examples/engine_zeroers.py (tests/test_examples.py judges it in CI; the
benchmark's full sweep is in docs/results.md). Here a small file of built-in designs, which run
fast, checks what the benchmark reports and how it exits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fuzz.bench.examples import main

FACTORIES = '''
from zeroer.designs import PerCallZeroer, SingleBufferZeroer
from zeroer.protocol import Capabilities

VERDICTS = {VERDICTS}
RUNTIME = Capabilities(api="runtime", follows_reallocation=True, geometries=("tiny",))


def staged_once(cache, runtime):
    return SingleBufferZeroer(cache, runtime, kernel="torch")


def staged_per_call(cache, runtime):
    return PerCallZeroer(cache, runtime, kernel="torch")


staged_once.capabilities = staged_per_call.capabilities = RUNTIME
'''


def _file(tmp_path: Path, verdicts: dict) -> str:
    path = tmp_path / "factories.py"
    path.write_text(FACTORIES.replace("{VERDICTS}", repr(verdicts)))
    return str(path)


def test_a_racy_and_a_race_free_factory_meet_every_target(tmp_path, capsys):
    spec = _file(tmp_path, {"staged_once": "racy", "staged_per_call": "race-free"})
    out = tmp_path / "out.json"
    status = main([spec, "--replays", "3", "--soak-steps", "200", "-j", "1", "--json", str(out),
                   "--repro-dir", str(tmp_path / "traces")])
    printed = capsys.readouterr().out
    assert status == 0, printed
    rows = {row["spec"].rsplit(":", 1)[1]: row for row in json.loads(out.read_text())["rows"]}
    racy, clean = rows["staged_once"], rows["staged_per_call"]
    assert racy["campaigns"] == racy["found"] == 3  # tiny's two shards and the x2 campaign
    assert racy["max_trace_ops"] <= 4 and racy["replayed"] == racy["replays"] == 9 and racy["met"]
    assert clean["found"] == 0 and clean["soak_steps"] >= 200 and clean["met"]
    assert "| `staged_once` | racy | 3 | 3 |" in printed and printed.count("| met |") == 2


def test_a_verdict_the_fuzzer_contradicts_exits_1(tmp_path, capsys):
    spec = _file(tmp_path, {"staged_once": "race-free"})  # it is racy: the fuzzer finds it
    status = main([spec, "--replays", "1", "-j", "1", "--repro-dir", str(tmp_path / "traces")])
    assert status == 1
    assert "| `staged_once` | race-free | 3 | 3 |" in capsys.readouterr().out


@pytest.mark.parametrize(("verdicts", "message"), [
    ({"staged_once": "buggy"}, "VERDICTS['staged_once'] = 'buggy'; each key must be a factory of the file and each "
                               "value one of racy, race-free"),
    ({"nothing": "racy"}, "VERDICTS['nothing'] = 'racy'; each key must be a factory of the file and each value one "
                          "of racy, race-free"),
])
def test_a_bad_verdicts_dict_is_one_line_naming_the_entry(tmp_path, capsys, verdicts, message):
    spec = _file(tmp_path, verdicts)
    assert main([spec]) == 2
    assert capsys.readouterr().err == f"error: {spec}: {message}\n"


def test_jobs_past_the_time_limit_are_reported_as_not_run_never_as_met(tmp_path, capsys):
    spec = _file(tmp_path, {"staged_per_call": "race-free"})
    out = tmp_path / "out.json"
    status = main([spec, "--max-seconds", "0.001", "-j", "1", "--json", str(out), "--repro-dir", str(tmp_path / "t")])
    assert status == 1
    (row,) = json.loads(out.read_text())["rows"]
    assert row["campaigns"] + row["not_run"] == 3 and row["not_run"] >= 2 and not row["met"]  # one may start in the first ms
    assert f"not all run ({row['not_run']} jobs left)" in capsys.readouterr().out
