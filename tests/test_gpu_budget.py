"""The suite on a machine with a GPU (tests/gpu_budget.py): ``-n auto`` sized by the GPU, and the GPU
slots every process of the suite shares, checked on a CPU with a fake device."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import gpu_budget
from gpu_budget import HELD, Slot, children_take_the_slot, gpu_memory_gib, plan, stays_off_the_gpu, uses_gpu

ROOT = Path(__file__).resolve().parents[1]


def test_one_gpu_holds_twelve_contexts_four_slots_for_the_childrens_and_eight_workers():
    # hardware queues bind, not bytes: an H100 and an H200 get the same budget
    assert plan(16, 81559 / 1024) == gpu_budget.GpuBudget(81559 / 1024, slots=4, workers=8)
    assert plan(16, 143771 / 1024) == gpu_budget.GpuBudget(143771 / 1024, slots=4, workers=8)
    assert plan(64, 8.0) == gpu_budget.GpuBudget(8.0, slots=1, workers=11)  # a small card: one test on it at a time
    assert plan(2, 79.6).workers == 2  # never more workers than CPUs


def test_the_slot_count_can_be_set_and_a_bad_count_names_the_value_and_the_fix():
    assert plan(16, 79.6, "3") == gpu_budget.GpuBudget(79.6, slots=3, workers=9)
    assert plan(16, 79.6, "0") == gpu_budget.GpuBudget(79.6, slots=0, workers=12)  # no slots: every context a worker's
    for bad in ("many", "-1", "2.5"):
        with pytest.raises(ValueError, match=rf"^KVZ_GPU_SLOTS='{bad}': give a whole number of slots \(0: no budget\)$"):
            plan(16, 79.6, bad)


def test_the_gpus_memory_is_read_from_nvidia_smi_and_none_where_it_cannot_say(monkeypatch):
    asked: list[list[str]] = []

    def smi(argv):
        asked.append(argv)
        return "81559\n"

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert gpu_memory_gib(smi) == pytest.approx(79.647, abs=1e-3)
    assert asked[0][-1] == "--id=3"  # the first visible GPU, which is cuda:0 to torch

    def missing(argv):
        raise FileNotFoundError("nvidia-smi")

    assert gpu_memory_gib(missing) is None
    assert gpu_memory_gib(lambda argv: "[N/A]\n") is None


def test_without_cuda_auto_keeps_xdists_own_count_and_no_test_takes_a_slot(monkeypatch):
    monkeypatch.setattr(gpu_budget, "cuda_available", lambda: False)
    assert gpu_budget.machine_budget() is None
    assert gpu_budget.auto_workers() is None


def test_with_a_gpu_auto_asks_the_budget(monkeypatch):
    monkeypatch.setattr(gpu_budget, "cuda_available", lambda: True)
    monkeypatch.setattr(gpu_budget, "gpu_memory_gib", lambda: 79.6)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.delenv("KVZ_GPU_SLOTS", raising=False)
    assert gpu_budget.auto_workers() == 8


FAKE_GPU = """
import os
import torch
torch.cuda.is_available = lambda: True   # a fake device: nothing here makes a CUDA call
os.cpu_count = lambda: 3
"""


def test_pytest_n_auto_starts_the_workers_a_fake_gpu_holds(tmp_path):
    # The README's test command as written, on a machine whose nvidia-smi says 24 GiB and whose
    # os.cpu_count() says 3: xdist asks the suite's hook, which says 3 (the CPUs bound it before the
    # GPU's 10); xdist's own rule counts the CPUs this process may run on, 2 on CI's machine.
    bin_dir, site = tmp_path / "bin", tmp_path / "site"
    bin_dir.mkdir()
    site.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 24576\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    (site / "sitecustomize.py").write_text(FAKE_GPU)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "KVZ_GPU"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]),
               KVZ_GPU_SLOTS_DIR=str(tmp_path / "slots"))
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "auto", "tests/test_layout.py", "-p", "no:randomly"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "3 workers [42 items]" in done.stdout, done.stdout[-2000:]


def test_a_slot_is_held_by_one_taker_at_a_time_and_freed_when_given_back(tmp_path):
    first, second = Slot(tmp_path, 1), Slot(tmp_path, 1)
    assert first.take(wait_s=0)
    started = time.monotonic()
    assert not second.take(wait_s=0.3, poll_s=0.01)  # the only slot is taken: it waits, then gives up
    assert time.monotonic() - started >= 0.3
    first.give_back()
    assert second.take(wait_s=0) and second.held
    second.give_back()


def test_a_slot_held_by_a_process_that_dies_is_free_again(tmp_path):
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        from gpu_budget import Slot
        assert Slot(__import__('pathlib').Path({str(tmp_path)!r}), 1).take(wait_s=0)
        print('held', flush=True)
        time.sleep(600)
    """)
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert not Slot(tmp_path, 1).take(wait_s=0)
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        assert Slot(tmp_path, 1).take(wait_s=5, poll_s=0.01)  # the kernel dropped the dead process's lock
    finally:
        holder.kill()
        holder.wait()


def test_a_test_takes_its_slot_when_it_starts_a_child_and_the_child_is_inside_it(tmp_path, monkeypatch):
    monkeypatch.delenv(HELD, raising=False)
    slot = Slot(tmp_path, 2)
    warnings: list[str] = []
    with children_take_the_slot(slot, warnings.append):
        assert not slot.held  # nothing started yet: no slot
        seen = subprocess.run([sys.executable, "-c", f"import os; print(os.environ.get({HELD!r}))"],
                              capture_output=True, text=True, check=True).stdout.strip()
        assert slot.held and seen == "1"
        subprocess.run([sys.executable, "-c", "pass"], check=True)  # a second child: the same slot
    assert subprocess.Popen.__init__ is not None and "start" not in subprocess.Popen.__init__.__name__
    slot.give_back()
    assert HELD not in os.environ and not warnings


def test_a_child_on_the_simulator_takes_no_slot_and_one_that_may_use_the_gpu_does(tmp_path, monkeypatch):
    monkeypatch.delenv(HELD, raising=False)
    slot = Slot(tmp_path, 1)
    code = "import sys; sys.exit(0)"
    with children_take_the_slot(slot, []):
        for argv in ([sys.executable, "-c", code, "fuzz", "--backend", "sim"],
                     [sys.executable, "-c", code, "--kvz-sanitize-backend=sim"]):
            subprocess.run(argv, check=True)
            assert not slot.held, argv
        subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
        assert not slot.held
        subprocess.run([sys.executable, "-c", code, "--backend", "sim", "--backend", "cuda"], check=True)
        assert slot.held  # one of its backends is the GPU
    slot.give_back()
    assert stays_off_the_gpu(([sys.executable, "-m", "sanitizer", "--backend", "sim"],), {})
    assert not stays_off_the_gpu(([sys.executable, "-m", "pytest", "fuzz"],), {})  # auto: the GPU where there is one
    assert not stays_off_the_gpu(("python -m pytest fuzz --backend sim",), {"shell": True})  # a shell line is not read
    assert stays_off_the_gpu((["git", "-C", str(ROOT), "rev-parse", "HEAD"],), {})  # the commit a report records
    assert stays_off_the_gpu((), {"args": ["/usr/bin/git", "status", "--porcelain"]})
    assert not stays_off_the_gpu((["bash", "-c", "git status && python -m pytest fuzz"],), {})


def test_a_test_that_needs_cuda_is_known_by_its_skip_mark():
    cuda = pytest.mark.skipif(False, reason="needs a CUDA GPU").mark
    gpu = pytest.mark.skipif(False, reason="needs a GPU").mark
    other = pytest.mark.skipif(False, reason="the redis package is not installed").mark
    assert uses_gpu([cuda]) and uses_gpu([gpu]) and not uses_gpu([other]) and not uses_gpu([])
