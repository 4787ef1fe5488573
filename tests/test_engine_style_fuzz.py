"""The code under test of tests/engine_style/ under the fuzzer, through factories, on the simulator.

``tests/engine_style/factories.py`` builds each piece of engine-style transfer code, unmodified,
over the harness's KV cache and host pool; here each is fuzzed in a subprocess as a user would run
``pytest fuzz --offloader``, on one geometry with a pinned pool (two campaigns, one per seed
shard). The race-free code must leave every campaign clean; its racy twin
(``ENGINE_STYLE_PLANTED_RACE=1``, the same twin the sanitizer's tests catch in
tests/test_engine_style.py) must be found in every campaign, by the call of the code that races.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FACTORIES = "tests/engine_style/factories.py"

# factory -> the call of the racy twin that a hazard names, and what it does to the block
PLANTED = {
    # the store reads the block without waiting for the caller's stream (vLLM #46278)
    "cpu_gpu_handler": ("store", "reads it"),
    # a load is acked before its finish event, so the caller reads the block mid-load (SGLang #27444)
    "hicache_controller": ("load", "writes it"),
}

# A campaign's line in the run's output: "[1/2] tests_engine_style_factories.py:...-tiny-sim-shard0: clean, ..."
CAMPAIGN_LINE = re.compile(r"\[\d+/\d+\] (\S+): ([^,\n]+)")


def fuzz(factory: str, planted: bool, tmp_path: Path) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    """One ``pytest fuzz --offloader`` run on ``tiny`` with a pinned pool; each campaign's verdict."""
    env = {key: value for key, value in os.environ.items() if key != "ENGINE_STYLE_PLANTED_RACE"}
    if planted:
        env["ENGINE_STYLE_PLANTED_RACE"] = "1"
    done = subprocess.run([sys.executable, "-m", "pytest", "fuzz", "--offloader", f"{FACTORIES}:{factory}",
                           "--backend", "sim", "--geometry", "tiny", "--host-memory", "pinned", "-p", "no:randomly",
                           "-q", "--repro-dir", str(tmp_path / "failures"), "--fuzz-summary",
                           str(tmp_path / "summary.json")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    return done, dict(CAMPAIGN_LINE.findall(done.stdout))


@pytest.mark.parametrize("factory", sorted(PLANTED))
def test_the_engine_style_code_leaves_every_fuzz_campaign_clean(factory: str, tmp_path: Path) -> None:
    done, verdicts = fuzz(factory, planted=False, tmp_path=tmp_path)
    out = done.stdout[-4000:] + done.stderr[-4000:]
    assert done.returncode == 0, out
    assert sorted(verdicts) == [f"tests_engine_style_factories.py:{factory}-tiny-sim-shard{i}" for i in (0, 1)], out
    assert set(verdicts.values()) == {"clean"}, out
    assert "harness error" not in done.stdout + done.stderr, out


@pytest.mark.parametrize("factory", sorted(PLANTED))
def test_the_racy_twin_is_found_by_the_fuzz_run_at_its_racing_call(factory: str, tmp_path: Path) -> None:
    # The run's verdict (exit 1) is what a user gets. A campaign may miss a six-op race on its shard
    # (docs/fuzzing.md): with CI=true's derandomized seeds, one of HiCache's does.
    done, verdicts = fuzz(factory, planted=True, tmp_path=tmp_path)
    out = done.stdout[-4000:] + done.stderr[-4000:]
    assert done.returncode == 1, out
    assert len(verdicts) == 2 and any(v.startswith("FINDING") for v in verdicts.values()), out
    assert all(v.startswith("FINDING") or v == "clean" for v in verdicts.values()), out
    assert "harness error" not in done.stdout + done.stderr, out
    call, access = PLANTED[factory]
    # The call's blocks: one in a fully shrunk trace, more where the shrink bound cut it short (a
    # loaded 2-core machine).
    hazard = re.compile(rf"^  - hazard at step \d+: block \d+: .*\({re.escape(FACTORIES)}:{factory}\.{call}#\d+\(\[[\d, ]+\]\)\) "
                        rf"{access}\b", re.M)
    assert hazard.search(done.stdout), out
