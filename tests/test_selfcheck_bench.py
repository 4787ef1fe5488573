"""``python -m fuzz.bench.selfcheck``: it picks the simulator's self-checks, sweeps one over seeds
and reports it, and a selection that matches nothing is a usage error listing what would.

The sweep's figures are measured by hand and recorded in docs/fuzzing.md ("Profiles").
"""

from __future__ import annotations

import json

import pytest

from fuzz.bench.selfcheck import main, name_of, self_checks


def test_the_self_checks_are_the_simulators_must_find_campaigns_once_each_without_the_interpreter():
    names = [name_of(c) for c in self_checks()]
    assert len(names) == len(set(names))
    assert {"single_buffer-tiny-sim-k-torch", "ring-tiny-sim-k-torch", "reference-tiny-sim-fault-no-free-fence",
            "zoo.ring_overrun-tiny-sim", "zoo.packed_overrun-packed-sim"} <= set(names)
    assert all(c.expect == "finds" and c.config.backend == "sim" and c.config.kernel != "triton"
               for c in self_checks())


def test_a_sweep_reports_every_seed_of_the_chosen_self_check(tmp_path, capsys):
    out = tmp_path / "selfcheck.json"
    assert main(["-k", "zoo.packed_overrun", "--seeds", "2", "--profile", "quick", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["profile"] == "quick" and report["seeds"] == [1, 2]
    [row] = report["rows"]
    assert row["campaign"] == "zoo.packed_overrun-packed-sim"
    assert row["found"] == 2 and row["missed_seeds"] == [] and row["examples_budget"] == 60 * 20
    assert 1 <= row["most_examples_to_first_finding"] <= row["examples_budget"]
    assert "| zoo.packed_overrun-packed-sim | 2/2 |" in capsys.readouterr().out


def test_a_selection_that_matches_nothing_lists_the_self_checks(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--geometry", "tiny", "-k", "packed"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error: no self-check matches --geometry tiny and -k packed; the self-checks are: " in err
    assert "zoo.packed_overrun-packed-sim" in err


def test_help_and_a_bad_seed_count(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0 and "--seeds" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["--seeds", "0"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().endswith(
        "argument --seeds: '0' is not a positive number of seeds, e.g. --seeds 10")
