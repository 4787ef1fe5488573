"""The harness exercises what the contract allows: one zeroer per gap, each found only that way.

Each zeroer of tests/contract_gap_zeroers.py breaks the contract in one place an earlier harness
never reached (the caller's reuse of its id container, two zeroers in one process, non-uniform
pages, many calls outstanding); each is found by ``pytest fuzz --zeroer`` on the simulator in the
quick profile, by the campaign family that reaches it, and the control stays clean everywhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fuzz.engine.campaigns import PROFILES, default_campaigns, run_campaign, spec_label

SPEC = "tests/contract_gap_zeroers.py"


def campaigns_of(name: str, **filters):
    pairs = default_campaigns(["sim"], f"{SPEC}:{name}")
    chosen = []
    for campaign, skipped in pairs:
        config = campaign.config
        if skipped or campaign.shard != 0:
            continue
        if all(getattr(config, key) == value for key, value in filters.items()):
            chosen.append(campaign)
    return chosen


@pytest.mark.parametrize(("name", "filters"), [
    ("KeepsCallersIds", {"geometry": "tiny", "zeroers": 1}),  # promise 3: the caller scribbles on its list
    ("SharedStaging", {"zeroers": 2}),  # two zeroers, one process: the multi family
    ("UniformPages", {"geometry": "mla_indexer", "zeroers": 1}),  # non-uniform pages: every geometry by default
    ("DeepRing", {"geometry": "tiny", "zeroers": 1}),  # five calls outstanding: deep queues
])
def test_each_gap_is_found_in_the_quick_profile(name, filters, tmp_path):
    chosen = campaigns_of(name, **filters)
    assert chosen, f"no campaign of {name} matches {filters}"
    for campaign in chosen:
        result = run_campaign(campaign.__class__(campaign.config, campaign.shard, "finds"), PROFILES["quick"], tmp_path)
        assert result.found, f"{campaign.id}: missed in {result.examples} examples"


def test_the_control_is_clean_in_every_family(tmp_path):
    for campaign in campaigns_of("ExactPages", geometry="tiny") + campaigns_of("ExactPages", zeroers=2):
        result = run_campaign(campaign, PROFILES["quick"], tmp_path)
        assert not result.found, result.violation


def test_an_outside_zeroer_runs_on_every_geometry_it_supports_and_the_rest_are_skipped_with_the_reason():
    from zeroer.cache.geometries import geometry_names

    geometries = {c.config.geometry for c, skipped in default_campaigns(["sim"], f"{SPEC}:ExactPages") if not skipped}
    assert geometries == set(geometry_names())


def test_campaign_ids_do_not_depend_on_where_the_checkout_lies(tmp_path):
    relative = f"{SPEC}:ExactPages"
    absolute = f"{Path(SPEC).resolve()}:ExactPages"
    elsewhere = f"/somewhere/else/{Path(SPEC).name}:ExactPages"
    assert spec_label(absolute) == relative
    assert spec_label(elsewhere) == "contract_gap_zeroers.py:ExactPages"
    ids = [c.id for c, _ in default_campaigns(["sim"], relative)]
    assert ids == [c.id for c, _ in default_campaigns(["sim"], absolute)]
    assert all("/" not in i and str(Path.cwd()) not in i for i in ids)


def test_two_checkouts_at_different_paths_fuzz_the_same_way(tmp_path):
    """The same campaign in two copies of the project (different absolute paths, different
    depths): the same id, seed, examples to the first finding, and the same shrunk trace."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    ignore = shutil.ignore_patterns("__pycache__", "failures", "*.pyc")
    results = []
    for checkout in (tmp_path / "a", tmp_path / "b" / "deeper"):
        # every package of the project (pyproject's list): where it is not pip-installed (the GPU
        # machine) the copy must stand alone, sanitizer.pytest_plugin included
        for part in ("fuzz", "zeroer", "kvdevice", "repro", "kvzero_fuzz", "racecheck", "sanitizer"):
            shutil.copytree(root / part, checkout / part, ignore=ignore)
        shutil.copy(root / "pyproject.toml", checkout)
        (checkout / "tests").mkdir()
        shutil.copy(root / SPEC, checkout / SPEC)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HYPOTHESIS"))}
        env["PYTHONPATH"] = str(checkout)
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "fuzz", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
             "--zeroer", f"{SPEC}:KeepsCallersIds", "--backend", "sim", "--geometry", "tiny", "-k", "tiny-sim-shard0",
             "--repro-dir", "out", "--fuzz-summary", "out/summary.json"],
            cwd=checkout, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
        (record,) = json.loads((checkout / "out" / "summary.json").read_text())["campaigns"]
        trace = json.loads(Path(checkout / record["trace"]).read_text())
        results.append((record["campaign"], record["seeds"], record["first_finding_examples"], trace["ops"]))
    assert results[0] == results[1]
    assert results[0][0] == "tests_contract_gap_zeroers.py:KeepsCallersIds-tiny-sim-shard0"
