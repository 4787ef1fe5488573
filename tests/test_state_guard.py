"""No state crosses tests (tests/state_guard.py), on a CPU.

On an H100 (``-n 6``), nine of the sanitizer's observer tests failed with an extra line
``kvz-sanitize cannot follow kvzero's CUDA harness runtime ...``: an earlier test of the same xdist
worker had left a CUDA harness runtime open, and every later observer of the process stepped aside
for it. Here: the same cause in a nested run of two tests (a runtime announced as the harness's and
left open by a test that fails, then an observer test), with and without the guard; the guard's
own undoing of each kind of state; and the suite's observer tests on the CUDA stand-in run in one
process after the tests that open harness runtimes, whose simulator runtimes announce themselves
there as the CUDA ones do on a GPU (tests/announced_simulator.py).
"""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

import state_guard
from fake_cuda import FakeCuda
from racecheck import effects, schedules, thread_hooks
from sanitizer.gpu.observer import Observer
from kvdevice.runtime import SimRuntime

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
HARNESS = "kvzero's CUDA harness runtime"

# Two tests of one process. The first announces a runtime as kvzero's CUDA harness runtime does
# (kvdevice/runtime/cuda/common.py) and fails before it closes it: pytest keeps the failure's frames
# (sys.last_traceback) until the next test's call begins, so the runtime is still open while the
# next test's fixtures start its observer, as tests/test_sanitizer_observer.py's ``obs`` does. The
# second is the sanitizer's: an observer on the CUDA stand-in, which must check everything.
LEAKING_THEN_OBSERVING = '''
import pytest
import torch

from fake_cuda import FakeCuda
from racecheck import schedules
from sanitizer.gpu.observer import Observer
from kvdevice.runtime import SimRuntime


def test_a_test_that_fails_before_it_closes_its_runtime():
    runtime = SimRuntime()
    schedules.started(runtime, "kvzero's CUDA harness runtime")
    assert runtime is None, "the test failed before its close()"
    runtime.close()


@pytest.fixture
def cuda():
    cuda = FakeCuda()
    cuda.obs = Observer(device=cuda)
    cuda.obs.start()
    yield cuda
    if cuda.obs._started:
        cuda.obs.stop()


def test_the_next_tests_observer_checks_everything(cuda):
    staging = cuda.pinned(torch.zeros(4, dtype=torch.int64))
    ids = cuda.device(torch.zeros(4, dtype=torch.int64))
    ids.copy_(staging, non_blocking=True)
    staging.numpy()[0] = 1  # a host write under the queued copy
    races = cuda.obs.stop()
    assert [u.message() for u in cuda.obs.take_unfollowed()] == []
    assert [r.kind for r in races] == ["host-write-vs-pending-copy"]
'''

# What opens harness runtimes (their simulator runtimes announced), then the sanitizer's observer
# tests on the CUDA stand-in, in this order.
OPENS_HARNESS_RUNTIMES = ["tests/test_designs.py", "tests/test_sim_conformance.py", "tests/test_offload.py",
                          "tests/test_engine_idioms.py"]
HARNESS_TESTS = [
    "tests/test_designs.py",
    "tests/test_sim_conformance.py",
    "tests/test_offload.py::test_each_racy_example_shows_on_its_shortest_program_and_not_on_its_twin",
    "tests/test_offload.py::test_a_load_first_reported_as_the_episode_ends_is_read_and_judged",
    # its cuda cases left their runtimes open on an H100 (the runtimes test_sim_conformance's
    # in_a_zeroer makes are closed by that module's fixture, which this module did not use)
    "tests/test_engine_idioms.py::test_the_fuzzers_interception_follows_each_idiom",
]
OBSERVER_TESTS = [
    "tests/test_sanitizer_observer.py",
    "tests/test_table_kernels.py::test_on_a_gpu_a_table_kernel_touches_what_its_staged_tables_say",
    "tests/test_table_kernels.py::test_on_a_gpu_tables_the_host_never_staged_are_one_line_that_names_each",
    "tests/test_custom_ops.py::test_the_gpu_observer_follows_a_modelled_op",
    "tests/test_custom_ops.py::test_the_gpu_observer_says_a_custom_op_with_no_model_in_one_line",
]


def run_pytest(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``python -m pytest ARGS`` in one process of its own (no xdist, fixed order), tests/ importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(ROOT), env.get("PYTHONPATH", "")])
    env.pop("PYTEST_XDIST_WORKER", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:randomly", "-p", "no:cacheprovider",
                           "-q", "-rA", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def outcomes(done: subprocess.CompletedProcess) -> dict[str, set[str]]:
    """Each test's outcomes in the short summary (``-rA``): PASSED, FAILED, ERROR (at teardown)."""
    found: dict[str, set[str]] = {}
    for outcome, test in re.findall(r"^(PASSED|FAILED|ERROR|SKIPPED) \S*?::(\w+)", done.stdout, re.M):
        found.setdefault(test, set()).add(outcome)
    return found


# -- the cause, in a nested run -----------------------------------------------------------------------

def test_a_runtime_a_failing_test_leaves_open_fails_that_test_at_teardown_and_the_next_test_passes(tmp_path):
    (tmp_path / "test_leak.py").write_text(LEAKING_THEN_OBSERVING)
    done = run_pytest(["-p", "state_guard", "test_leak.py"], tmp_path)
    assert outcomes(done) == {"test_a_test_that_fails_before_it_closes_its_runtime": {"FAILED", "ERROR"},
                              "test_the_next_tests_observer_checks_everything": {"PASSED"}}, done.stdout[-4000:]
    assert re.search(r"this test left state open for the tests after it \(closed now\):\n  - kvzero's CUDA "
                     r"harness runtime still open in racecheck\.schedules \(SimRuntime: close\(\) it\)",
                     done.stdout), done.stdout[-4000:]


def test_without_the_guard_the_runtime_left_open_sets_the_next_tests_observer_aside(tmp_path):
    # The failure seen on the GPU, far from its cause: the next test's observer steps aside.
    (tmp_path / "test_leak.py").write_text(LEAKING_THEN_OBSERVING)
    done = run_pytest(["test_leak.py"], tmp_path)
    assert outcomes(done) == {"test_a_test_that_fails_before_it_closes_its_runtime": {"FAILED"},
                              "test_the_next_tests_observer_checks_everything": {"FAILED"}}, done.stdout[-4000:]
    assert f"kvz-sanitize cannot follow {HARNESS} (it orders streams with gate kernels no hook sees)" in done.stdout


def test_an_observer_does_not_step_aside_for_a_runtime_dropped_without_close():
    # What is dropped is no longer running, though its cycles keep it registered until the collector
    # runs (a CUDA runtime's do): a subscriber collects before it asks what runs (racecheck.schedules).
    class Dropped:
        def __init__(self) -> None:
            self.cycle = self

    collecting = gc.isenabled()
    gc.disable()  # no collection by chance between the drop and the observer's start
    try:
        schedules.started(Dropped(), HARNESS)
        assert len(schedules.live()) == 1
        obs = Observer(device=FakeCuda())
        obs.start()
        obs.stop()
    finally:
        if collecting:
            gc.enable()
    assert obs.take_unfollowed() == [] and schedules.live() == []


# -- the suite's observer tests after its harness tests, in one process --------------------------------

def test_the_observer_tests_on_the_cuda_stand_in_pass_after_the_tests_that_open_harness_runtimes():
    announced = [arg for name in OPENS_HARNESS_RUNTIMES for arg in ("--announce-simulator", name)]
    done = run_pytest(["-p", "state_guard", "-p", "announced_simulator", *announced, *HARNESS_TESTS,
                       *OBSERVER_TESTS], ROOT)
    found = outcomes(done)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert not any(outcome & {"FAILED", "ERROR"} for outcome in found.values()), done.stdout[-6000:]
    # Both groups ran: the harness tests on the simulator, the observer tests on the stand-in.
    assert {"PASSED"} == found["test_race_free_designs_zero_every_block_on_the_racy_interleavings"]
    assert {"PASSED"} == found["test_on_a_gpu_a_table_kernel_touches_what_its_staged_tables_say"]
    assert {"PASSED"} == found["test_the_gpu_observer_follows_a_modelled_op"]


# -- what the guard undoes ------------------------------------------------------------------------------

class _Watch:
    """A thread watch that follows nothing (racecheck.thread_hooks.ThreadWatch)."""

    def thread_starting(self, thread):
        return None

    def thread_running(self, thread, token):
        return lambda: None

    def thread_setup(self):
        return None

    def release(self, obj):
        pass

    def acquire(self, obj):
        pass


def test_the_guard_names_and_undoes_each_kind_of_state_a_test_leaves_open():
    before = state_guard.open_state()
    synchronize = torch.cuda.synchronize
    runtime = SimRuntime()
    schedules.started(runtime, HARNESS)
    watch = _Watch()
    thread_hooks.activate(watch)
    routing, extensions = effects.routing(lambda *args: None), effects.extension_modules()
    routing.__enter__()  # held open: a generator's scope dropped would close itself
    extensions.__enter__()
    TorchFunctionMode().__enter__()
    torch.cuda.synchronize = lambda device=None: None
    leaked = state_guard.undo_leaks(before)
    assert leaked == [
        f"{HARNESS} still open in racecheck.schedules (SimRuntime: close() it)",
        "a thread watch still active (_Watch): the patched threading, queue and time primitives still act for it",
        "a router of modelled calls still routing (test_the_guard_names_and_undoes_each_kind_of_state_a_test_leaves_open"
        ".<locals>.<lambda>)",
        leaked[3],  # the extension scope: how many functions it wrapped depends on what is installed
        "torch function modes left on the stack: TorchFunctionMode",
        "torch.cuda.{synchronize} still patched",
    ]
    assert leaked[3].startswith("extension functions still routed (")
    assert schedules.live() == [] and thread_hooks.watches() == [] and effects.open_routes() == []
    assert torch._C._len_torch_function_stack() == 0 and torch.cuda.synchronize is synchronize
    assert state_guard.undo_leaks(before) == []


class _OurFinder:
    def find_spec(self, *args):
        return None


def test_a_library_s_import_finder_stays_and_one_of_ours_is_taken_away():
    # six puts _SixMetaPathImporter on sys.meta_path when matplotlib's dateutil imports it (the H100
    # image): the library's for the process's life, not a test's leak; taking it away breaks six
    library = type("_SixMetaPathImporter", (_OurFinder,), {"__module__": "six"})()
    ours = _OurFinder()
    before = state_guard.open_state()
    sys.meta_path.extend([library, ours])
    try:
        assert state_guard.undo_leaks(before) == ["an import finder left on sys.meta_path (_OurFinder)"]
        assert library in sys.meta_path and ours not in sys.meta_path
    finally:
        for finder in (library, ours):
            if finder in sys.meta_path:
                sys.meta_path.remove(finder)


def test_an_observer_left_started_is_named_once_and_its_stop_undoes_its_patches():
    before = state_guard.open_state()
    numpy = torch.Tensor.numpy
    Observer(device=FakeCuda()).start()
    assert torch.Tensor.numpy is not numpy
    assert state_guard.undo_leaks(before) == ["a sanitizer observer still started (Observer: stop() it)"]
    assert torch.Tensor.numpy is numpy and torch._C._len_torch_dispatch_stack() == 0
    assert state_guard.undo_leaks(before) == []


def test_an_observer_whose_start_fails_half_way_leaves_nothing_installed(monkeypatch):
    from sanitizer.gpu import dispatch

    def fails(observer):
        raise RuntimeError("no mode today")

    monkeypatch.setattr(dispatch, "enter", fails)
    before = state_guard.open_state()
    obs = Observer(device=FakeCuda())
    with pytest.raises(RuntimeError, match=r"^no mode today$"):
        obs.start()
    assert not obs._started
    assert state_guard.undo_leaks(before) == []


def test_an_episode_whose_factory_raises_closes_its_runtime(monkeypatch):
    from fuzz.engine.episode import Episode, EpisodeConfig
    from fuzz.engine.harness_error import HarnessError

    closed = []
    close = SimRuntime.close
    monkeypatch.setattr(SimRuntime, "close", lambda rt: (closed.append(rt), close(rt)))
    with pytest.raises(HarnessError, match=r"no load\(\)"):
        Episode(EpisodeConfig(offloader="tests/test_offload.py:NoLoad"))
    assert len(closed) == 1


def test_a_helper_thread_parked_at_the_end_of_a_test_is_ended():
    # What the fuzzer's helper threads are when their zeroer is never closed: started under a
    # scheduling watch, parked until their turns close (kvdevice.intercept.helper_threads).
    from racecheck.turns import TurnsClosed

    release = threading.Event()

    class Parking(_Watch):
        def thread_starting(self, thread):
            return "token"

        def close(self):
            release.set()

    def parked():
        release.wait()
        raise TurnsClosed()

    before = state_guard.open_state()
    watch = Parking()
    deactivate = thread_hooks.activate(watch)
    thread = threading.Thread(target=parked, name="copy-thread", daemon=True)
    thread.start()
    deactivate()
    leaked = state_guard.undo_leaks(before)
    assert leaked == ["helper thread 'copy-thread' of the code under test still parked (Parking: its zeroer or "
                      "offloader was not closed)"]
    assert not thread.is_alive()
