"""The package's pytest plugins load into every pytest run where it is installed (entry points): an
engine's own test run keeps the CUDA settings it chose. Only a run that collects the fuzz campaigns
and may run them on a GPU asks for eager module loading and 32 hardware queues, which its gated
streams need (on an H100, eager loading made a plain run's first CUDA call take 4.4 s instead of
0.65 s, and the overhead benchmark's plain baseline paid it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ("CUDA_MODULE_LOADING", "CUDA_DEVICE_MAX_CONNECTIONS")


def _settings_seen(tmp_path: Path, *args: str) -> list[str]:
    """The two variables as a pytest run with the package's plugins sees them once it has collected."""
    (tmp_path / "settings_probe.py").write_text(
        "import os\n"
        "def pytest_collection_finish(session):\n"
        f"    print('SETTINGS', *(os.environ.get(n, '-') for n in {SETTINGS!r}))\n")
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS}  # this suite's own process set them
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-p", "settings_probe", "-p", "fuzz.plugin", "-p", "sanitizer.pytest_plugin",
                           "-c", os.devnull, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    line = next((l for l in done.stdout.splitlines() if l.startswith("SETTINGS")), None)
    assert line is not None, done.stdout + done.stderr
    return line.split()[1:]


def test_an_engines_own_test_run_keeps_its_cuda_settings(tmp_path):
    tests = tmp_path / "engine_tests"
    tests.mkdir()
    (tests / "test_engine.py").write_text("def test_step():\n    pass\n")
    assert _settings_seen(tmp_path, "--rootdir", str(tests), str(tests)) == ["-", "-"]


@pytest.mark.parametrize(("args", "asked"), [
    (["fuzz"], True),  # the README's main job
    (["fuzz/test_campaigns.py"], True),
    (["--backend", "sim", "fuzz"], False),  # the simulator has no CUDA context to set up
    (["--pyargs", "fuzz"], True),
])
def test_only_a_run_that_collects_the_campaigns_asks_for_the_gates_settings(tmp_path, args, asked):
    seen = _settings_seen(tmp_path, "--rootdir", str(ROOT), *args)
    assert seen == (["EAGER", "32"] if asked else ["-", "-"])
