"""``fuzz/targets.py``: every default simulator campaign as a Hypothesis stateful TestCase, which
pytest, unittest and HypoFuzz collect and run; ``pytest fuzz`` does not collect it.

The HypoFuzz test runs HypoFuzz's own collection, then its CLI (``hypothesis fuzz``, dashboard
off) on a race-free campaign and a racy one until HypoFuzz has run examples of the first and
recorded a failure of the second, and reads both from the example database HypoFuzz wrote. It is
skipped when hypofuzz is not installed (``pip install -e '.[fleet]'``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import unittest
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

import fuzz.targets as targets
from fuzz.engine.campaigns import PROFILES, default_campaigns

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ROOT / "fuzz" / "targets.py"
CLEAN = "reference_tiny_sim_shard0"
RACY = "single_buffer_tiny_sim_k_torch_shard0"


def subprocess_env() -> dict[str, str]:
    """This environment without pytest-xdist's worker variables and without CI (under CI,
    Hypothesis's ci profile turns the database off, and HypoFuzz needs one)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k != "CI"}


# -- the module ------------------------------------------------------------------------------------


def test_every_runnable_simulator_campaign_has_a_test_case_named_after_its_id():
    expected = sorted(targets.class_name(c.id) for c, skipped in default_campaigns(["sim"]) if skipped is None)
    found = sorted(name for name, value in vars(targets).items()
                   if isinstance(value, type) and issubclass(value, unittest.TestCase) and value.__module__ == targets.__name__)
    assert found == expected
    assert "single_buffer_tiny_sim_k_torch_shard0" in found and "zoo_ring_overrun_tiny_sim_shard0" in found


def test_a_campaign_id_becomes_a_python_identifier():
    assert targets.class_name("zoo.ring_overrun-tiny-sim-shard0") == "zoo_ring_overrun_tiny_sim_shard0"
    assert targets.class_name("mine.py:make-tiny-sim-shard0") == "mine_py_make_tiny_sim_shard0"
    assert targets.class_name("3d-tiny-sim-shard0") == "campaign_3d_tiny_sim_shard0"


def test_each_test_case_is_hypofuzz_shaped():
    case = getattr(targets, RACY)
    assert case.runTest._hypothesis_state_machine_class.__name__ == RACY
    assert case.settings.stateful_step_count == PROFILES["quick"].steps
    assert case.settings.max_examples == PROFILES["quick"].max_examples
    assert case.settings.deadline is None
    assert case.settings.database == settings().database  # HypoFuzz declines a test with its own database
    assert HealthCheck.nested_given not in case.settings.suppress_health_check  # and one that suppresses this


def test_a_racy_campaigns_test_case_fails_with_the_shrunk_program():
    result = unittest.TestResult()
    getattr(targets, RACY)("runTest").run(result)
    assert len(result.failures) == 1, result.errors
    report = result.failures[0][1]
    assert "the vLLM #48085 hazard" in report
    assert f"state = {RACY}()" in report


def test_pytest_fuzz_does_not_collect_the_targets_module():
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "fuzz", "--backend", "sim", "--collect-only", "-q", "-p", "no:xdist"],
        cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "fuzz/test_campaigns.py::test_campaign[" in result.stdout
    assert "targets.py" not in result.stdout


# -- HypoFuzz --------------------------------------------------------------------------------------

COLLECT = """
import json, sys
from hypofuzz.collection import collect_tests
result = collect_tests(sys.argv[1:])
print(json.dumps({"targets": {t.nodeid: t.database_key_str for t in result.fuzz_targets},
                  "not_collected": {k: v["status_reason"] for k, v in result.not_collected.items()}}))
"""


def hypofuzz_database(directory: Path):
    from hypofuzz.database import HypofuzzDatabase
    from hypothesis.database import DirectoryBasedExampleDatabase

    return HypofuzzDatabase(DirectoryBasedExampleDatabase(directory / ".hypothesis" / "examples"))


def progress(database, key: bytes) -> tuple[int, int]:
    """(examples HypoFuzz has reported for this test, failures it has recorded for it)."""
    from hypofuzz.database.models import FailureState
    from hypothesis.internal.conjecture.data import Status

    reports = database.reports.fetch(key)
    examples = max((sum(r.status_counts.get(s, 0) for s in Status) for r in reports), default=0)
    failures = sum(len(list(database.failures(state=s).fetch(key))) for s in (FailureState.SHRUNK, FailureState.UNSHRUNK))
    return examples, failures


def stop(run: subprocess.Popen) -> str:
    """End a HypoFuzz run (it fuzzes until stopped) and all its worker processes; its output."""
    if run.poll() is None:
        os.killpg(run.pid, signal.SIGTERM)
    try:
        return run.communicate(timeout=30)[0]
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        return run.communicate()[0]


def test_hypofuzz_collects_every_campaign_and_fuzzes_a_clean_and_a_racy_one(tmp_path):
    pytest.importorskip("hypofuzz", reason="hypofuzz is not installed (pip install -e '.[fleet]')")
    from hypofuzz.database.utils import convert_db_key

    hypothesis_cli = shutil.which("hypothesis", path=str(Path(sys.executable).parent))
    if hypothesis_cli is None:
        pytest.skip("the hypothesis command (hypothesis[cli]) is not next to this Python")
    env = subprocess_env()

    # HypoFuzz's own collection: pytest --collect-only -m hypothesis, then its filters.
    collected = subprocess.run([sys.executable, "-c", COLLECT, str(TARGETS), "-p", "no:xdist"], cwd=tmp_path,
                               env=env, capture_output=True, text=True, timeout=300)
    assert collected.returncode == 0, collected.stdout + collected.stderr
    found = json.loads(collected.stdout.splitlines()[-1])
    names = sorted(nodeid.split("::")[1] for nodeid in found["targets"])
    assert names == sorted(targets.class_name(c.id) for c, skipped in default_campaigns(["sim"]) if skipped is None)
    assert found["not_collected"] == {}
    keys = {nodeid.split("::")[1]: convert_db_key(key, to="bytes") for nodeid, key in found["targets"].items()}

    # HypoFuzz's CLI, one run per campaign (a run that fuzzes both would spend itself on the race),
    # until it has run examples of the clean one and recorded a failure of the racy one.
    runs = {name: subprocess.Popen(
        [hypothesis_cli, "fuzz", "--no-dashboard", "-n", "1", "--", str(TARGETS), "-p", "no:xdist", "-k", name],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        for name in (CLEAN, RACY)}
    database = hypofuzz_database(tmp_path)
    started = time.monotonic()
    try:
        while time.monotonic() - started < 240 and runs[CLEAN].poll() is None:
            clean, racy = progress(database, keys[CLEAN]), progress(database, keys[RACY])
            if clean[0] >= 10 and racy[1] >= 1:
                break
            time.sleep(1)
    finally:
        outputs = {name: stop(run) for name, run in runs.items()}
    seconds = time.monotonic() - started
    clean, racy = progress(database, keys[CLEAN]), progress(database, keys[RACY])
    print(f"hypofuzz, {seconds:.0f} s: {CLEAN}: {clean[0]} examples, {clean[1]} failures; "
          f"{RACY}: {racy[0]} examples, {racy[1]} failures")
    assert all("using 1 process to fuzz 1 test" in output for output in outputs.values()), outputs
    assert clean[0] >= 10 and clean[1] == 0, outputs[CLEAN][-3000:]
    assert racy[1] >= 1, outputs[RACY][-3000:]
