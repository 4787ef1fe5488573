"""``python -m repro replay``: a fuzzer trace replays through the same executor, and a bad trace
file is one line naming the file and the field, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from fuzz.engine.episode import EpisodeConfig
from fuzz.engine.trace import write_trace
from repro.__main__ import main

RACE = [{"op": "start", "in_flight": 1}, {"op": "allocate", "n": 1, "stream": 0}, {"op": "allocate", "n": 1, "stream": 0}]


def trace(tmp_path: Path, zeroer: str) -> Path:
    return write_trace(tmp_path, EpisodeConfig(zeroer=zeroer, kernel=None), RACE, [], seed=1)


def test_a_racy_trace_reproduces_and_exits_1(tmp_path, capsys):
    assert main(["replay", str(trace(tmp_path, "single_buffer"))]) == 1
    out = capsys.readouterr().out
    assert "vLLM #48085" in out and out.rstrip().endswith("reproduced 1 of 1 on sim")


def test_the_same_ops_on_a_race_free_zeroer_exit_0(tmp_path, capsys):
    assert main(["replay", str(trace(tmp_path, "per_call")), "--repeat", "3"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("reproduced 0 of 3 on sim")


def test_a_different_finding_is_a_finding_but_not_the_recorded_bug_shown_again(tmp_path, capsys):
    """A trace that recorded a race, replayed against a zeroer that now raises: exit 1 (a finding),
    reproduced 0 (it is not the race), and the replay says which it was."""
    from fuzz.engine.oracle import Finding

    recorded = [Finding("hazard", None, "hazard at step 2: ...", False, "")]
    path = write_trace(tmp_path, EpisodeConfig(zeroer="tests/bad_zeroers.py:RaisingZeroer", kernel=None), RACE,
                       recorded, seed=1)
    assert main(["replay", str(path), "--repeat", "2"]) == 1
    out = capsys.readouterr().out
    assert "zeroer raised at step 2" in out and "reproduced 0 of 2 on sim" in out
    assert out.rstrip().endswith("2 of 2 showed a different finding than the trace recorded (hazard): the first is printed above")


def test_trace_names_are_content_hashes_so_rewrites_do_not_clobber(tmp_path):
    assert trace(tmp_path, "ring") == trace(tmp_path, "ring")
    assert len(list(tmp_path.glob("*.json"))) == 1


@pytest.mark.parametrize(
    "content, message",
    [
        (None, r"no such file"),
        ("{not json", r"invalid JSON at line 1 column 2: "),
        ('{"version": 7, "config": {}, "ops": []}', r"field 'version' is 7; this replayer reads version 1"),
        ('{"version": 1, "ops": []}', r"missing field 'config'"),
        ('{"version": 1, "config": {"zeroer": "ring", "colour": 1}, "ops": []}', r"field 'config.colour' is not a config field"),
        ('{"version": 1, "config": {}, "ops": [{"op": "start"}, {"op": "explode"}]}', r"field 'ops\[1\].op' is 'explode'; known ops: "),
    ],
)
def test_a_bad_trace_is_one_line_naming_the_file_and_field_exit_2(tmp_path, capsys, content, message):
    path = tmp_path / "t.json"
    if content is not None:
        path.write_text(content)
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"error: {path}: ")
    import re

    assert re.search(message, err)


def test_repeat_must_be_positive(tmp_path, capsys):
    assert main(["replay", str(trace(tmp_path, "ring")), "--repeat", "0"]) == 2
    assert capsys.readouterr().err == "error: --repeat 0 must be at least 1\n"
