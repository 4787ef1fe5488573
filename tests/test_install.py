"""kvzero-fuzz installed for real, used from a directory that has nothing of the checkout.

A fresh virtualenv (no system site-packages), torch 2.13.0 (the CPU build, from this machine's
disk where pip is set up that way), then a non-editable ``pip install`` of the checkout. In an
empty directory (no checkout on ``sys.path``, the working directory itself) a user writes two
zeroers against the runtime, a racy one-persistent-buffer design and a fresh-buffer-per-call one,
and fuzzes them the ways the docs give: ``python -m pytest -p fuzz.plugin --zeroer ...``,
``python -m pytest --pyargs fuzz --zeroer ...`` and plain ``python -m pytest --zeroer ...``
through the entry point. The racy one must fail (exit 1) and leave a trace that
``kvzero-repro replay`` reproduces; the race-free one must pass. The sanitizer's own entry point
(``pytest --kvz-sanitize``, with the fuzzer's plugin turned off) and its console script
(``kvzero-sanitize``) must judge a user's racy and race-free staging on the simulator. Every
console script must start.

Installing takes a minute or more, so this runs only when asked::

    KVZERO_INSTALL_TESTS=1 python -m pytest tests/test_install.py -s

(``-s`` prints how long each step took). The package is installed from a copy of the checkout's
files (tracked and untracked, not ignored: what ``git ls-files`` lists), so the build writes no
``build/`` or ``*.egg-info`` into the shared checkout and no stale ``build/lib`` file can slip into
the wheel. The dependencies' wheels are kept in ``$KVZERO_WHEEL_CACHE`` (default
``~/.cache/kvzero-fuzz/wheels``): once it holds them, the install runs offline from it (pip's own
HTTP cache stays empty on this machine), and only the checkout's wheel is built each time.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ONE_CAMPAIGN = "tiny and shard0 and not x2"  # a user zeroer's tiny-geometry campaign, first shard

pytestmark = [
    pytest.mark.slow_install,
    pytest.mark.skipif(os.environ.get("KVZERO_INSTALL_TESTS") != "1",
                       reason="installs into a fresh virtualenv (minutes); set KVZERO_INSTALL_TESTS=1 to run it"),
]

RACY = '''"""A user's zeroer against kvzero-fuzz's runtime: one persistent pinned staging buffer (racy)."""
from zeroer.designs.common import zero_blocks_torch
from zeroer.protocol import Capabilities


class OneBuffer:
    capabilities = Capabilities(api="runtime")

    def __init__(self, cache, runtime):
        self.cache, self.rt = cache, runtime
        self.host = runtime.host_buffer(cache.spec.num_blocks)
        self.dev = runtime.device_buffer(cache.spec.num_blocks, name="one_buffer ids")

    def zero_block_ids(self, block_ids):
        ids = [int(b) for b in (block_ids if block_ids is not None else [])]
        if not ids:
            return
        self.rt.write_host(self.host, ids)  # an earlier call's copy may not have read it yet
        self.rt.copy_h2d(self.dev, self.host, len(ids))
        view, cache = self.dev.tensor[:len(ids)], self.cache
        self.rt.launch(lambda: zero_blocks_torch(cache, view), name="zero", reads=[self.dev], blocks_written=ids)


def make(cache, runtime):
    return OneBuffer(cache, runtime)


make.capabilities = OneBuffer.capabilities  # the factory declares it: written against the runtime, not intercepted
'''

CLEAN = '''"""A user's zeroer against kvzero-fuzz's runtime: a fresh pinned staging buffer per call."""
from zeroer.designs.common import zero_blocks_torch
from zeroer.protocol import Capabilities


class FreshBuffer:
    capabilities = Capabilities(api="runtime")

    def __init__(self, cache, runtime):
        self.cache, self.rt = cache, runtime

    def zero_block_ids(self, block_ids):
        ids = [int(b) for b in (block_ids if block_ids is not None else [])]
        if not ids:
            return
        host = self.rt.host_buffer(len(ids))  # from the caching host allocator: not reused before its copy ran
        self.rt.write_host(host, ids)
        dev = self.rt.device_buffer(len(ids), name="fresh ids")
        self.rt.copy_h2d(dev, host, len(ids))
        view, cache = dev.tensor[:len(ids)], self.cache
        self.rt.launch(lambda: zero_blocks_torch(cache, view), name="zero", reads=[dev], blocks_written=ids)
        self.rt.free_host(host)


def make(cache, runtime):
    return FreshBuffer(cache, runtime)


make.capabilities = FreshBuffer.capabilities  # the factory declares it: written against the runtime, not intercepted
'''


ENGINE_TESTS = '''import torch


def test_racy_staging():
    buf = torch.empty(4, dtype=torch.int64, pin_memory=True)
    dev = torch.zeros(4, dtype=torch.int64, device="cuda")
    for step in range(3):
        buf.numpy()[:] = step
        dev.copy_(buf, non_blocking=True)
    torch.cuda.synchronize()


def test_fresh_staging():
    dev = torch.zeros(4, dtype=torch.int64, device="cuda")
    for step in range(3):
        dev.copy_(torch.full((4,), step, dtype=torch.int64).pin_memory(), non_blocking=True)
    torch.cuda.synchronize()
    assert dev.tolist() == [2] * 4
'''

ENGINE_SCRIPT = '''import torch

counts = torch.arange(4, dtype=torch.int32, device="cuda")
host = torch.zeros(4, dtype=torch.int32, pin_memory=True)
view = host.numpy()
host.copy_(counts, non_blocking=True)
print(int(view[3]))  # the copy may not have landed: a host read under it
'''


class Steps:
    """Runs commands and remembers how long each took."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.times: list[tuple[str, float]] = []

    def run(self, label: str, command: list[str], cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
        started = time.monotonic()
        result = subprocess.run(command, cwd=cwd, env=self.env, capture_output=True, text=True, timeout=timeout)
        self.times.append((label, time.monotonic() - started))
        return result


def install_checkout(steps: Steps, python: str, source: Path, wheels: Path) -> subprocess.CompletedProcess:
    """``pip install SOURCE`` offline from the wheel cache; when that lacks something, online,
    and then fill the cache with what was installed (setuptools too: the isolated build needs it)."""
    offline = steps.run("pip install <checkout> (offline, from the wheel cache)",
                        [python, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels), str(source)],
                        cwd=source.parent)
    if offline.returncode == 0:
        return offline
    online = steps.run("pip install <checkout> (online)", [python, "-m", "pip", "install", "-q", str(source)],
                       cwd=source.parent)
    if online.returncode != 0:
        return online
    frozen = subprocess.run([python, "-m", "pip", "freeze", "--exclude", "torch", "--exclude", "kvzero-fuzz"],
                            env=steps.env, capture_output=True, text=True, check=True).stdout
    requirements = source.parent / "wheel-cache-requirements.txt"
    requirements.write_text(frozen + "setuptools\n")
    steps.run("pip download (fill the wheel cache)", [python, "-m", "pip", "download", "-q", "--no-deps", "-d",
                                                       str(wheels), "-r", str(requirements)], cwd=source.parent)
    return online


def copy_checkout(destination: Path) -> Path:
    """The checkout's files as git sees them (tracked, and untracked but not ignored)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    return destination


def test_the_installed_plugin_fuzzes_a_users_zeroer_from_an_empty_directory(tmp_path):
    wheels = Path(os.environ.get("KVZERO_WHEEL_CACHE", Path.home() / ".cache" / "kvzero-fuzz" / "wheels"))
    venv, work = tmp_path / "venv", tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME") and not k.startswith("PYTEST_")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    steps = Steps(env)
    python = str(venv / "bin" / "python")

    made = steps.run("python -m venv", [sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    torch = steps.run("pip install torch==2.13.0", [python, "-m", "pip", "install", "-q", "torch==2.13.0"], cwd=tmp_path)
    assert torch.returncode == 0, torch.stdout + torch.stderr
    source = copy_checkout(tmp_path / "source")
    installed = install_checkout(steps, python, source, wheels)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    where = subprocess.run([python, "-c", "import fuzz, kvzero_fuzz; print(fuzz.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True)
    assert where.stdout.startswith(str(venv)), where.stdout + where.stderr  # the installed copy, not a checkout

    (work / "racy.py").write_text(RACY)
    (work / "clean.py").write_text(CLEAN)
    pytest_ = [python, "-m", "pytest", "--backend", "sim", "-q", "-k", ONE_CAMPAIGN]

    racy = steps.run("pytest -p fuzz.plugin --zeroer racy.py:make", [*pytest_, "-p", "fuzz.plugin", "--zeroer", "racy.py:make"], cwd=work)
    assert racy.returncode == 1, racy.stdout + racy.stderr
    assert "1 failed" in racy.stdout and "the vLLM #48085 hazard" in racy.stdout, racy.stdout
    traces = sorted(p for p in (work / "repro" / "failures").glob("racy*.json") if p.suffixes == [".json"])
    assert len(traces) == 1, racy.stdout
    replay = steps.run("kvzero-repro replay TRACE", [str(venv / "bin" / "kvzero-repro"), "replay", str(traces[0])], cwd=work)
    assert replay.returncode == 1 and "reproduced 1 of 1 on sim" in replay.stdout, replay.stdout + replay.stderr

    clean = steps.run("pytest -p fuzz.plugin --zeroer clean.py:make", [*pytest_, "-p", "fuzz.plugin", "--zeroer", "clean.py:make"], cwd=work)
    assert clean.returncode == 0 and "1 passed" in clean.stdout, clean.stdout + clean.stderr

    pyargs = steps.run("pytest --pyargs fuzz --zeroer racy.py:make", [*pytest_, "--pyargs", "fuzz", "--zeroer", "racy.py:make"], cwd=work)
    assert pyargs.returncode == 1 and "1 failed" in pyargs.stdout, pyargs.stdout + pyargs.stderr
    pyargs_clean = steps.run("pytest --pyargs fuzz --zeroer clean.py:make", [*pytest_, "--pyargs", "fuzz", "--zeroer", "clean.py:make"], cwd=work)
    assert pyargs_clean.returncode == 0 and "1 passed" in pyargs_clean.stdout, pyargs_clean.stdout + pyargs_clean.stderr

    plain = steps.run("pytest --zeroer clean.py:make (entry point)", [*pytest_, "--zeroer", "clean.py:make"], cwd=work)
    assert plain.returncode == 0 and "1 passed" in plain.stdout, plain.stdout + plain.stderr
    plain_racy = steps.run("pytest --zeroer racy.py:make (entry point)", [*pytest_, "--zeroer", "racy.py:make"], cwd=work)
    assert plain_racy.returncode == 1 and "1 failed" in plain_racy.stdout, plain_racy.stdout + plain_racy.stderr

    # The sanitizer, through its own entry point and its console script, on the simulator.
    (work / "test_engine_step.py").write_text(ENGINE_TESTS)
    sanitized = steps.run("pytest --kvz-sanitize --kvz-sanitize-backend sim (entry point)",
                          [python, "-m", "pytest", "-q", "-p", "no:fuzz.plugin", "--kvz-sanitize",
                           "--kvz-sanitize-backend", "sim", "test_engine_step.py"], cwd=work)
    assert sanitized.returncode == 1 and "1 failed, 1 passed" in sanitized.stdout, sanitized.stdout + sanitized.stderr
    assert "[host-write-vs-pending-copy]" in sanitized.stdout
    (work / "step.py").write_text(ENGINE_SCRIPT)
    script_run = steps.run("kvzero-sanitize --backend sim -- python step.py",
                           [str(venv / "bin" / "kvzero-sanitize"), "--backend", "sim", "--", "python", "step.py"], cwd=work)
    assert script_run.returncode == 1 and "step.py:7 (<module>)" in script_run.stdout, script_run.stdout + script_run.stderr

    for script in ("kvzero-repro", "kvzero-detect", "kvzero-bench-kernel", "kvzero-bench-speed", "kvzero-bench-intercept",
                   "kvzero-bench-examples", "kvzero-bench-offload", "kvzero-sanitize"):
        started = steps.run(f"{script} --help", [str(venv / "bin" / script), "--help"], cwd=work)
        assert started.returncode == 0 and "usage:" in started.stdout, started.stdout + started.stderr

    print("\n" + "\n".join(f"{seconds:7.1f} s  {label}" for label, seconds in steps.times))
