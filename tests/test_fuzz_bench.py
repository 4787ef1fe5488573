"""``python -m fuzz.bench.speed --quick`` still runs and writes its report (the numbers themselves are
measured by hand and recorded in docs/fuzzing.md, never asserted in a timed test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_quick_benchmark_runs_and_reports_every_zeroer_and_race(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-m", "fuzz.bench.speed", "--quick", "--backend", "sim", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert [r["zeroer"] for r in report["throughput"]] == ["reference", "per_call", "event_ring"]
    assert not any(r["found"] for r in report["throughput"])
    assert "steps/s median (min-max) over seeds" in done.stdout
