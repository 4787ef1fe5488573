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
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ("CUDA_MODULE_LOADING", "CUDA_DEVICE_MAX_CONNECTIONS")


def _settings_seen(tmp_path: Path, *args: str, cwd: Path | None = None) -> list[str]:
    """The two variables as a pytest run with the package's plugins sees them once it has collected,
    and whether anything asked torch's GPU check (which starts CUDA's driver) by then: ``-``, or
    ``driver@`` and the two as they were at the first check."""
    (tmp_path / "settings_probe.py").write_text(
        "import os, torch\n"
        "asked = []  # torch's GPU check starts CUDA's driver, which reads the settings as they are then\n"
        "check = torch.cuda.is_available\n"
        f"def seen(): return [os.environ.get(n, '-') for n in {SETTINGS!r}]\n"
        "torch.cuda.is_available = lambda: asked.append(','.join(seen())) or check()\n"
        "def pytest_collection_finish(session):\n"
        "    print('SETTINGS', *seen(), 'driver@' + asked[0] if asked else '-')\n")
    # this suite's own process set them; a user's PYTEST_ADDOPTS would change the runs
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS and k != "PYTEST_ADDOPTS"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-p", "settings_probe", "-p", "fuzz.plugin", "-p", "sanitizer.pytest_plugin",
                           "-c", os.devnull, *args], cwd=cwd or ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    line = next((l for l in done.stdout.splitlines() if l.startswith("SETTINGS")), None)
    assert line is not None, done.stdout + done.stderr
    return line.split()[1:]


def test_an_engines_own_test_run_keeps_its_cuda_settings(tmp_path):
    tests = tmp_path / "engine_tests"
    tests.mkdir()
    (tests / "test_engine.py").write_text("def test_step():\n    pass\n")
    assert _settings_seen(tmp_path, "--rootdir", str(tests), str(tests)) == ["-", "-", "-"]


@pytest.mark.parametrize(("args", "elsewhere", "asked"), [
    (["fuzz"], False, True),  # the README's main job
    (["fuzz/test_campaigns.py"], False, True),
    (["--backend", "sim", "fuzz"], False, False),  # the simulator has no CUDA context to set up
    (["--pyargs", "fuzz"], True, True),  # from another directory: a module, not a path
    (["--zeroer", "ring"], True, True),  # the installed campaigns, collected for it
])
def test_only_a_run_that_collects_the_campaigns_asks_for_the_gates_settings(tmp_path, args, elsewhere, asked):
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    seen = _settings_seen(tmp_path, "--rootdir", str(cwd if elsewhere else ROOT), *args, cwd=cwd if elsewhere else None)
    assert seen[:2] == (["EAGER", "32"] if asked else ["-", "-"])


def test_a_sanitized_run_of_the_campaigns_asks_for_them_before_the_sanitizer_asks_for_the_gpu(tmp_path):
    """``pytest --kvz-sanitize fuzz``: the sanitizer's configure asks torch whether there is a GPU,
    which starts CUDA's driver; the settings are asked for first, or the driver never reads them."""
    seen = _settings_seen(tmp_path, "--rootdir", str(ROOT), "--kvz-sanitize", "fuzz/test_campaigns.py")
    assert seen == ["EAGER", "32", "driver@EAGER,32"]


def test_a_project_root_whose_virtualenv_holds_the_package_is_not_a_run_of_its_campaigns(tmp_path):
    """An engine's ``pytest .`` (or ``pytest`` with no arguments) at a root holding its ``.venv``:
    pytest never walks into the virtualenv, so the installed campaigns there are not collected."""
    from fuzz.plugin import _collected_below

    installed = tmp_path / ".venv" / "lib" / "python3.12" / "site-packages" / "fuzz" / "test_campaigns.py"
    installed.parent.mkdir(parents=True)
    (tmp_path / ".venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    options = {"collect_in_virtualenv": False}
    config = SimpleNamespace(getoption=lambda name, default=None: options.get(name, default),
                             getini=lambda name: [".*", "build", "venv"])
    assert not _collected_below(config, tmp_path, installed)
    assert _collected_below(config, tmp_path / ".venv" / "lib" / "python3.12" / "site-packages", installed)
    options["collect_in_virtualenv"] = True
    assert _collected_below(config, tmp_path, installed)
    assert _collected_below(SimpleNamespace(getoption=lambda name, default=None: False, getini=lambda name: []),
                            ROOT, ROOT / "fuzz" / "test_campaigns.py")  # this checkout's own layout
