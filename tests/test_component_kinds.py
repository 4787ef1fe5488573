"""A kind of component declared outside the caller core (fuzz.engine.episode, ops, machine) is
taken by it unedited: its config field and options, its trace ops, its side, its machine part,
and what its code raises filed under its name. Run in a fresh interpreter, since the core reads
the kinds as it loads (tests/third_component_kind.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_third_kind_of_component_runs_with_no_edit_to_the_caller_core() -> None:
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "third_component_kind.py")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("OK"), run.stdout + run.stderr
