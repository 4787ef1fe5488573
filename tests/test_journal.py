"""The in-flight journal: a worker killed mid-episode (a CUDA fault) still leaves its ops, and
the run names the trace it was turned into."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from fuzz.engine.episode import EpisodeConfig
from fuzz.engine.journal import Journal, journal_path, rescue

ROOT = Path(__file__).resolve().parents[1]
CONFIG = EpisodeConfig(zeroer="single_buffer", kernel="torch")
OPS = [{"op": "start", "in_flight": 1}, {"op": "allocate", "n": 1, "stream": 0}]


def test_the_journal_holds_every_op_so_far_as_a_trace(tmp_path):
    journal = Journal(tmp_path, "gw3", "single_buffer-tiny-sim-k-torch-shard0", seed=5)
    journal.record(CONFIG, OPS[:1])
    journal.record(CONFIG, OPS)
    data = json.loads(journal_path(tmp_path, "gw3").read_text())
    assert data["ops"] == OPS and data["status"] == "in-flight" and data["seed"] == 5
    assert data["environment"]["torch"]
    assert [p.name for p in tmp_path.iterdir()] == [".inflight-gw3.json"]  # no temp files left
    journal.discard()
    assert not any(tmp_path.iterdir())


def test_rescue_turns_the_journal_into_a_crash_trace_naming_the_last_op(tmp_path):
    Journal(tmp_path, "gw0", "c-shard0", seed=5).record(CONFIG, OPS)
    path = rescue(tmp_path, "gw0", "c-shard0")
    data = json.loads(path.read_text())
    assert path.name.startswith("single_buffer-tiny-") and data["ops"] == OPS
    assert data["findings"][0]["kind"] == "crash"
    assert data["findings"][0]["message"] == 'worker gw0 died (a CUDA fault or another crash) while running op 1: {"op": "allocate", "n": 1, "stream": 0}'
    assert not journal_path(tmp_path, "gw0").exists()


def test_rescue_ignores_a_journal_of_another_campaign(tmp_path):
    Journal(tmp_path, "gw0", "other-shard0").record(CONFIG, OPS)
    assert rescue(tmp_path, "gw0", "c-shard0") is None
    assert rescue(tmp_path, "gw1", "c-shard0") is None


CRASHER = '''
import os
from zeroer.designs import PerCallZeroer

class Crasher(PerCallZeroer):
    """Dies like a worker hit by a CUDA fault, on its first call after the warm-up."""

    def zero_block_ids(self, block_ids):
        if list(block_ids) != [0]:
            os._exit(3)
        super().zero_block_ids(block_ids)

def make(cache, runtime):
    return Crasher(cache, runtime, kernel="torch")


make.capabilities = Crasher.capabilities  # a runtime-API zeroer: not intercepted
'''


def test_a_crashed_worker_is_reported_with_the_trace_of_the_ops_it_was_running(tmp_path):
    (tmp_path / "crasher.py").write_text(textwrap.dedent(CRASHER))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    traces = tmp_path / "traces"
    command = [
        sys.executable, "-m", "pytest", "fuzz", "-p", "no:cacheprovider", "-n", "1", "-q",
        "--backend", "sim", "--zeroer", f"{tmp_path / 'crasher.py'}:make", "-k", "tiny and shard0 and not triton and not x2",
        "--fuzz-journal", "on", "--repro-dir", str(traces),
        "--fuzz-summary", str(tmp_path / "summary.json"), "--fuzz-db", str(tmp_path / "db"),
    ]
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    output = run.stdout + run.stderr
    assert run.returncode == 1, output
    assert "crashed while running" in output, output
    saved = sorted(traces.glob("crasher_py_make-tiny-*.json"))
    assert len(saved) == 1, output
    assert f"the ops it was running are saved in {saved[0]}" in output
    data = json.loads(saved[0].read_text())
    assert data["findings"][0]["kind"] == "crash"
    assert data["ops"][-1]["op"] == "allocate"  # the warm-up zeroed block 0, the first allocation died
