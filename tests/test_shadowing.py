"""The check that ``fuzz``, ``repro`` and ``zeroer`` are this distribution's packages
(``kvzero_fuzz/shadowing.py``): its message as a pure function of what was found, then pytest
in a subprocess with a fake ``fuzz`` package, and with a fake distribution that installs one,
ahead of ours on ``sys.path``."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvzero_fuzz.shadowing import OWN_PACKAGES, Found, owner_of, resolve, shadowing_message


def exactly(message: str) -> str:
    return "^" + re.escape(message) + "$"


OURS = [Found("fuzz", "/site/fuzz/__init__.py", ours=True), Found("repro", "/site/repro/__init__.py", ours=True),
        Found("zeroer", "/site/zeroer/__init__.py", ours=True)]


# -- the message, from made-up findings ------------------------------------------------------------


def test_nothing_is_reported_when_every_package_is_ours():
    assert shadowing_message(OURS) is None


def test_a_package_no_distribution_provides_is_named_with_its_directory_and_the_fix():
    found = [Found("fuzz", "/home/me/repo/fuzz/__init__.py", ours=False), *OURS[1:]]
    assert re.match(exactly(
        "kvzero-fuzz cannot load: 'import fuzz' finds /home/me/repo/fuzz/__init__.py, a 'fuzz' package that no "
        "installed distribution provides: its directory /home/me/repo comes before kvzero-fuzz on sys.path "
        "(python -m pytest puts the current directory first; so does PYTHONPATH). Fix: run from a directory "
        "without a 'fuzz' package, or rename that package"), shadowing_message(found))


def test_another_distribution_is_named_with_the_commands_that_fix_it():
    found = [Found("repro", "/venv/site-packages/repro/__init__.py", ours=False, owner="repro-tools")]
    assert re.match(exactly(
        "kvzero-fuzz cannot load: 'import repro' finds /venv/site-packages/repro/__init__.py, which the "
        "distribution 'repro-tools' installed: another project's top-level 'repro' package shadows "
        "kvzero-fuzz's, and the two cannot share an environment. Fix: pip uninstall repro-tools && pip install "
        "--force-reinstall kvzero-fuzz (the reinstall restores any file the other one overwrote), or give "
        "kvzero-fuzz its own virtualenv"), shadowing_message(found))


def test_our_own_file_without_the_marker_asks_for_a_reinstall():
    found = [Found("zeroer", "/venv/site-packages/zeroer/__init__.py", ours=False, owner="kvzero_fuzz")]
    assert re.match(exactly(
        "kvzero-fuzz cannot load: 'import zeroer' finds /venv/site-packages/zeroer/__init__.py, installed by "
        "kvzero-fuzz but without its marker (__distribution__): another install overwrote it, or it is left "
        "from an older version. Fix: pip install --force-reinstall kvzero-fuzz"), shadowing_message(found))


def test_a_plain_directory_hiding_an_editable_install_is_explained():
    found = [Found("repro", None, ours=False, namespace=("/tmp/run/repro",))]
    assert re.match(exactly(
        "kvzero-fuzz cannot load: 'import repro' finds /tmp/run/repro, a directory without an __init__.py, "
        "instead of kvzero-fuzz's package: an editable install (pip install -e) is searched after every "
        "directory on sys.path, so a plain 'repro' directory there hides it. Run from another directory, or "
        "install kvzero-fuzz without -e"), shadowing_message(found))


def test_a_missing_package_asks_for_a_reinstall():
    assert re.match(exactly(
        "kvzero-fuzz cannot load: 'import zeroer' finds no package of kvzero-fuzz: the installation is "
        "incomplete; reinstall it with: pip install --force-reinstall kvzero-fuzz"),
        shadowing_message([Found("zeroer", None, ours=False)]))


def test_several_shadowed_packages_are_named_on_one_line():
    found = [Found("fuzz", "/r/fuzz/__init__.py", ours=False), Found("repro", None, ours=False), OURS[2]]
    message = shadowing_message(found)
    assert "\n" not in message
    assert re.match(r"^kvzero-fuzz cannot load: 'import fuzz' finds /r/fuzz/__init__.py, .*; and 'import repro' "
                    r"finds no package of kvzero-fuzz: .*kvzero-fuzz$", message)


# -- this interpreter ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", OWN_PACKAGES)
def test_this_checkout_resolves_to_our_own_packages(name):
    assert resolve(name).ours


def test_the_owner_of_a_file_is_the_distribution_whose_record_lists_it():
    assert owner_of(pytest.__file__, ["pytest"]) == "pytest"
    assert owner_of(pytest.__file__, ["hypothesis"]) is None
    assert owner_of(pytest.__file__, ["no-such-distribution"]) is None


# -- pytest with a shadowing package ---------------------------------------------------------------


ROOT = Path(__file__).resolve().parents[1]


def _entry_point_installed() -> bool:
    """Whether a process outside the checkout sees our entry point (the checkout's own
    kvzero_fuzz.egg-info, if a build left one, is only seen from the checkout)."""
    outside = [p for p in sys.path if p and Path(p).resolve() != ROOT]
    return any(point.name == "fuzz.plugin" and point.value == "kvzero_fuzz.pytest_plugin"
               for dist in importlib.metadata.distributions(path=outside)
               for point in dist.entry_points if point.group == "pytest11")


needs_entry_point = pytest.mark.skipif(
    not _entry_point_installed(), reason="kvzero-fuzz is not installed with its pytest11 entry point (pip install -e .)")


def run_pytest(*args: str, cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, "-m", "pytest", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


@needs_entry_point
@pytest.mark.parametrize("plugin_args", [(), ("-p", "fuzz.plugin")], ids=["entry-point", "-p fuzz.plugin"])
def test_a_fuzz_package_in_the_current_directory_stops_pytest_with_the_fix(tmp_path, plugin_args):
    (tmp_path / "fuzz").mkdir()
    (tmp_path / "fuzz" / "__init__.py").write_text('"""A fuzz package of some other project."""\n')
    result = run_pytest(*plugin_args, "--zeroer", "per_call", "--backend", "sim", "-q", cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert re.fullmatch(
        re.escape(
            f"error: kvzero-fuzz cannot load: 'import fuzz' finds {tmp_path / 'fuzz' / '__init__.py'}, a 'fuzz' package "
            f"that no installed distribution provides: its directory {tmp_path} comes before kvzero-fuzz on "
            f"sys.path") + r" \(python -m pytest puts .*rename that package\n", result.stderr), result.stderr


@needs_entry_point
def test_another_distribution_installing_fuzz_is_named_in_the_error(tmp_path):
    site = tmp_path / "site"  # a distribution 'fuzz-other' with a top-level 'fuzz', on PYTHONPATH
    (site / "fuzz").mkdir(parents=True)
    (site / "fuzz" / "__init__.py").write_text("")
    info = site / "fuzz_other-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fuzz-other\nVersion: 1.0\n")
    (info / "RECORD").write_text("fuzz/__init__.py,,\nfuzz_other-1.0.dist-info/METADATA,,\nfuzz_other-1.0.dist-info/RECORD,,\n")
    work = tmp_path / "work"
    work.mkdir()
    result = run_pytest("--zeroer", "per_call", "--backend", "sim", "-q", cwd=work, pythonpath=site)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith(
        f"error: kvzero-fuzz cannot load: 'import fuzz' finds {site / 'fuzz' / '__init__.py'}, which the "
        f"distribution 'fuzz-other' installed"), result.stderr
    assert "pip uninstall fuzz-other && pip install --force-reinstall kvzero-fuzz" in result.stderr


@needs_entry_point
def test_another_projects_plain_pytest_runs_beside_a_directory_that_hides_ours(tmp_path):
    # A project with a repro/ directory of its own (no __init__.py) hides our editable repro package
    # from a run started there: its own pytest must run as if kvzero-fuzz were not installed, and
    # only a run that asks for our plugins stops, with the fix.
    (tmp_path / "repro").mkdir()
    (tmp_path / "repro" / "notes.json").write_text("{}")
    (tmp_path / "test_theirs.py").write_text("def test_it():\n    assert True\n")
    theirs = run_pytest("-q", "-p", "no:cacheprovider", cwd=tmp_path)
    assert theirs.returncode == 0 and "1 passed" in theirs.stdout, theirs.stdout + theirs.stderr
    ours = run_pytest("-q", "-p", "no:cacheprovider", "--kvz-sanitize", cwd=tmp_path)
    assert ours.returncode == 2, ours.stdout + ours.stderr
    assert ours.stderr.startswith(f"error: kvzero-fuzz cannot load: 'import repro' finds {tmp_path / 'repro'}, a "
                                  f"directory without an __init__.py"), ours.stderr


def test_a_command_line_asks_for_us_by_option_plugin_or_a_path_in_the_checkout(tmp_path):
    from kvzero_fuzz.shadowing import asks_for_us

    assert asks_for_us(["--kvz-sanitize"], cwd=tmp_path) and asks_for_us(["-p", "fuzz.plugin"], cwd=tmp_path)
    assert asks_for_us(["--zeroer=ring", "-q"], cwd=tmp_path) and asks_for_us([str(ROOT / "fuzz")], cwd=tmp_path)
    assert asks_for_us([], cwd=ROOT) and asks_for_us(["tests/test_x.py::test_y"], cwd=ROOT)
    assert not asks_for_us([], cwd=tmp_path) and not asks_for_us(["-k", "fuzz", "tests"], cwd=tmp_path)
