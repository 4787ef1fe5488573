"""tests/bytecode_cache.py: where bytecode is off, the run's processes share one cache in the temp folder."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from bytecode_cache import share_bytecode_cache

ROOT = Path(__file__).resolve().parent.parent


def test_bytecode_turned_off_gets_a_cache_in_the_temp_folder_and_sources_stay_unwritten():
    environ = {"PYTHONDONTWRITEBYTECODE": "1", "PATH": "/bin"}
    prefix = share_bytecode_cache(environ)
    assert prefix == os.path.join(tempfile.gettempdir(), f"kvzero-pycache-{os.getuid()}")
    assert environ == {"PYTHONPYCACHEPREFIX": prefix, "PATH": "/bin"}


@pytest.mark.parametrize("environ", [{}, {"PYTHONDONTWRITEBYTECODE": ""},
                                     {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": "/mine"}])
def test_nothing_changes_where_bytecode_is_written_or_the_run_chose_its_own_cache(environ):
    before = dict(environ)
    assert share_bytecode_cache(environ) is None and environ == before


@pytest.mark.skipif(not os.environ.get("KVZ_BYTECODE_PROBE"), reason="the inner run of the test below")
def test_probe_what_a_child_of_a_test_inherits():
    done = subprocess.run([sys.executable, "-c", "import sys; print(sys.dont_write_bytecode, sys.pycache_prefix)"],
                          capture_output=True, text=True, check=True)
    print("CHILD", done.stdout.strip(), "SELF", sys.dont_write_bytecode, sys.pycache_prefix)


def test_a_run_with_bytecode_off_gives_its_tests_and_their_children_the_cache():
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "KVZ_BYTECODE_PROBE": "1"}
    env.pop("PYTHONPYCACHEPREFIX", None)
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:state_guard", "-q", "-s",
                           "tests/test_bytecode_cache.py::test_probe_what_a_child_of_a_test_inherits"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(line for line in done.stdout.splitlines() if "CHILD" in line)
    child, own = line.split("CHILD ")[1].split(" SELF ")
    assert child.startswith("False ") and "kvzero-pycache-" in child, line
    assert own.startswith("False ") and "kvzero-pycache-" in own, line
