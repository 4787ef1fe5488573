"""The sanitizer on a real GPU (skipped without CUDA): force mode's verdicts, the pytest plugin, and
stepping aside for kvzero's own harness. Run on the H200 by the sanitizer's evidence command
(sanitizer/bench/evidence.sh), beside tests/test_sanitizer_observer.py, whose race-logic tests run
on the GPU there too, and beside the benchmark table (every program under observe and force mode,
judged by kind and both lines), which ``test_each_program_gets_its_verdict_on_the_gpu`` repeats
one program at a time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

from sanitizer.bench.compare import EVERY, run_one
from sanitizer.bench.corpus import BY_NAME as CORPUS
from sanitizer.bench.programs import BY_NAME as PROGRAMS
from sanitizer.bench.programs import Program
from sanitizer.bench.verdict import CLEAN, FOUND

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
ROOT = Path(__file__).resolve().parents[1]


def _sanitize(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    report = tmp_path / "races.json"
    done = subprocess.run([sys.executable, "-m", "sanitizer", "--json", str(report), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    return done, json.loads(report.read_text()) if report.exists() else {}


def _shown(row: dict) -> str:
    """The whole row, error line included (pytest would cut a dict's repr short)."""
    return json.dumps(row)


@pytest.mark.parametrize("mode", ["observe", "force"])
@pytest.mark.parametrize("program", EVERY, ids=lambda p: p.name)
def test_each_program_gets_its_verdict_on_the_gpu(program: Program, mode: str) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        row = run_one(mode, program, 16, "cuda", Path(scratch))
    assert row["verdict"] == (FOUND if program.racy else CLEAN), _shown(row)


@pytest.mark.parametrize("name", ["block_table_one_buffer", "kv_offload_shared_bounce"])
def test_force_mode_makes_a_pinned_staging_race_deliver_the_wrong_values_and_says_which(tmp_path, name) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        row = run_one("force", PROGRAMS[name], 16, "cuda", Path(scratch))
    assert row["verdict"] == FOUND and row["forced_values"], _shown(row)
    assert row["values_wrong"], "the program's own check should fail once the copy is held"
    assert "was staged when it was queued" in row["forced_values"][0]


@pytest.mark.parametrize("name", ["vllm_36013_read_before_event", "vllm_48085_zeroer_one_pinned_buffer",
                                  "cuda_graph_static_input_rewritten"])
def test_force_mode_makes_a_corpus_race_show_as_wrong_values(name) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        row = run_one("force", CORPUS[name], 16, "cuda", Path(scratch))
    assert row["verdict"] == FOUND and row["values_wrong"], _shown(row)


@pytest.mark.parametrize("name", ["vllm_36013_event_then_read", "vllm_48085_zeroer_fresh_pinned",
                                  "cuda_graph_static_input_event", "vllm_async_output_thread_event_sync"])
def test_force_mode_leaves_a_race_free_twins_values_right(name) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        row = run_one("force", CORPUS[name], 16, "cuda", Path(scratch))
    assert row["verdict"] == CLEAN and not row["values_wrong"], row


def test_force_mode_names_the_held_copy_when_a_read_it_cannot_see_fails_the_program(tmp_path) -> None:
    program = tmp_path / "unseen_read.py"
    program.write_text(textwrap.dedent("""
        import numpy as np
        import torch

        counts = torch.arange(1, 5, dtype=torch.int64, device="cuda")
        host = torch.zeros(4, dtype=torch.int64, pin_memory=True)
        plain = np.asarray(host)  # a plain ndarray: reads through it are not seen
        for step in range(4):
            torch.cuda._sleep(1_000_000)
            host.copy_(counts * (step + 1), non_blocking=True)
            assert plain.sum() == 10 * (step + 1), f"step {step}: read {plain.tolist()} before the copy landed"
            torch.cuda.synchronize()
    """))
    done, data = _sanitize(tmp_path, "--force", "--", "python", str(program))
    assert done.returncode == 1, done.stdout + done.stderr
    (race,) = data["races"]
    assert race["kind"] == "host-read-vs-pending-copy" and race["queued"]["site"]["line"] == 10, race
    assert "could not see as it happened" in race["later"]["what"]


def test_force_mode_blames_no_copy_it_released_when_a_race_free_program_fails_on_its_own(tmp_path) -> None:
    program = tmp_path / "fails_after_sync.py"
    program.write_text(textwrap.dedent("""
        import torch

        counts = torch.arange(1, 5, dtype=torch.int64, device="cuda")
        host = torch.zeros(4, dtype=torch.int64, pin_memory=True)
        host.copy_(counts, non_blocking=True)  # held by force mode until the synchronisation below
        torch.cuda.synchronize()
        raise ValueError("the program's own failure, after the copy was seen complete")
    """))
    done, data = _sanitize(tmp_path, "--force", "--", "python", str(program))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "ValueError" in done.stderr and not (data or {}).get("races"), data


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
                           "-p", "sanitizer.pytest_plugin", "--rootdir", str(tmp_path), "-c", os.devnull,
                           "--kvz-sanitize", str(tmp_path / "test_gpu_engine.py")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 1 and "1 failed, 1 passed" in done.stdout, done.stdout + done.stderr
    assert "test_gpu_engine.py:8 (test_racy)" in done.stdout


def test_the_sanitizer_steps_aside_for_kvzeros_harness_and_resumes_after_it() -> None:
    from fuzz.engine.episode import Episode, EpisodeConfig
    from sanitizer.gpu.observer import Observer

    obs = Observer()
    obs.start()
    try:
        # Free mode: the harness issues work as it comes (its controlled mode, whose first launch of
        # a kernel behind closed gates needs warming up first, is covered by the suite's own tests).
        episode = Episode(EpisodeConfig(zeroer="single_buffer", backend="cuda", mode="free"))
        try:
            for op in ({"op": "allocate", "n": 2}, {"op": "allocate", "n": 2, "stream": 1}, {"op": "sync_device"}):
                episode.apply(op)
        finally:  # closed whatever an op raised: an open harness runtime would keep every later observer aside
            episode.abandon()
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
