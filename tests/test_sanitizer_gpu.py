"""The sanitizer on a real GPU (skipped without CUDA): every benchmark program under observe and
force mode, each in a fresh process, and ``pytest --kvz-sanitize`` on a small suite.

Run on the H200 as part of the sanitizer evidence (docs/sanitizer.md, "Results").
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

from sanitizer.bench.compare import run_one, verdict
from sanitizer.bench.programs import PROGRAMS, ZEROERS, Program

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("mode", ["observe", "force"])
@pytest.mark.parametrize("program", PROGRAMS + ZEROERS, ids=lambda p: p.name)
def test_each_program_gets_its_verdict_on_the_gpu(program: Program, mode: str) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        row = run_one(mode, program, 16, "cuda", Path(scratch))
    want = "found" if program.racy else "clean"
    assert verdict(row) == want, row


def test_force_mode_shows_the_wrong_values_of_a_pinned_staging_race() -> None:
    program = next(p for p in PROGRAMS if p.name == "block_table_one_buffer")
    with tempfile.TemporaryDirectory() as scratch:
        row = run_one("force", program, 16, "cuda", Path(scratch))
    assert row["found"] and row["forced_values"], row
    assert row["values_wrong"], "the program's own check should fail once the copy is held"


def test_pytest_plugin_on_the_gpu(tmp_path: Path) -> None:
    (tmp_path / "test_gpu_engine.py").write_text(textwrap.dedent("""
        import torch

        def test_racy():
            buf = torch.empty(8, dtype=torch.int64, pin_memory=True)
            dev = torch.zeros(8, dtype=torch.int64, device="cuda")
            for s in range(4):
                buf.numpy()[:4] = [s, s + 1, s + 2, s + 3]
                dev[:4].copy_(buf[:4], non_blocking=True)
            torch.cuda.synchronize()

        def test_clean():
            dev = torch.zeros(4, dtype=torch.int64, device="cuda")
            for s in range(4):
                dev.copy_(torch.tensor([s] * 4).pin_memory(), non_blocking=True)
            torch.cuda.synchronize()
            assert dev.tolist() == [3] * 4
    """))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "fuzz.plugin",
                           "--rootdir", str(tmp_path), "-c", os.devnull, "--kvz-sanitize",
                           str(tmp_path / "test_gpu_engine.py")], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 1 and "1 failed, 1 passed" in done.stdout, done.stdout + done.stderr
    assert "test_gpu_engine.py:9 (test_racy)" in done.stdout


def test_the_sanitizer_steps_aside_for_kvzeros_harness_and_resumes_after_it() -> None:
    from fuzz.engine.episode import Episode, EpisodeConfig
    from sanitizer.observer import Observer

    obs = Observer()
    obs.start()
    try:
        # Free mode: the harness issues work as it comes (its controlled mode, whose first launch of
        # a kernel behind closed gates needs warming up first, is covered by the suite's own tests).
        episode = Episode(EpisodeConfig(zeroer="single_buffer", backend="cuda", mode="free"))
        for op in ({"op": "allocate", "n": 2}, {"op": "allocate", "n": 2, "stream": 1}, {"op": "sync_device"}):
            episode.apply(op)
        episode.rt.close()
        assert obs.take_races() == []  # the harness's gated schedule is not the program's
        notes = [u.message() for u in obs.take_unfollowed()]
        assert len(notes) == 1 and "harness runtime" in notes[0], notes
        buf = torch.empty(8, dtype=torch.int64, pin_memory=True)  # checking resumed: a plain race is seen
        dev = torch.zeros(8, dtype=torch.int64, device="cuda")
        for s in range(3):
            buf.numpy()[:] = s
            dev.copy_(buf, non_blocking=True)
    finally:
        races = obs.stop()
    assert any(r.kind == "host-write-vs-pending-copy" for r in races), races
