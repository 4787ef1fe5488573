"""Threads the code under test starts: one at a time, in a fixed order (racecheck/turns.py), their
torch work followed through the session (kvdevice/intercept/helper_threads.py)."""

from __future__ import annotations

import json
import queue
import threading
import time
from pathlib import Path

import pytest

from fuzz.engine.episode import EpisodeConfig
from fuzz.engine.minimize import run_ops
from racecheck import thread_hooks
from racecheck.turns import TurnDeadlock, Turns

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = "examples/engine_offloaders.py"
STORE = [{"op": "start"}, {"op": "allocate", "n": 1}, {"op": "store", "block": 1}]


class _Watch:
    """The least thread watch that schedules: turns, no happens-before."""

    def __init__(self, turns: Turns) -> None:
        self.turns = turns

    def scheduling(self) -> bool:
        return self.turns.holding()

    def wait_turn(self, obj, condition, timeout):
        return self.turns.wait_turn(obj, condition, timeout)

    def thread_starting(self, thread):
        return self.turns.add(thread, thread.name) if self.turns.holding() else None

    def thread_running(self, thread, member):
        if member is None:
            return lambda: None
        self.turns.begin(member)
        return lambda: self.turns.finish(member)

    def thread_setup(self):
        return None

    def release(self, obj) -> None:
        pass

    def acquire(self, obj) -> None:
        pass


def _scheduled(body):
    """Run ``body(log)`` on this thread as the caller of a set of turns; return the log."""
    turns = Turns()
    thread_hooks.install()
    deactivate = thread_hooks.activate(_Watch(turns))
    log: list[str] = []
    turns.enter()
    try:
        body(log)
        turns.settle()
    finally:
        turns.leave()
        deactivate()
        turns.close()
    return log


def _workers(log, jobs):
    def worker(name):
        while True:
            item = jobs.get()
            if item is None:
                return
            log.append(f"{name}:{item}")
            time.sleep(0.001)  # a turn passes here: the other worker may run

    return [threading.Thread(target=worker, args=(n,), name=n, daemon=True) for n in ("a", "b")]


def test_helpers_run_one_at_a_time_in_the_same_order_on_every_run():
    def body(log):
        jobs = queue.Queue()
        workers = _workers(log, jobs)
        for w in workers:
            w.start()
        for item in range(6):
            jobs.put(item)
        log.append("caller waits")
        for _ in workers:
            jobs.put(None)
        for w in workers:
            w.join()
        log.append("joined")

    runs = [_scheduled(body) for _ in range(5)]
    assert all(run == runs[0] for run in runs)
    assert runs[0][0] == "caller waits"  # nothing ran while the caller held the turn
    assert sorted(int(e.split(":")[1]) for e in runs[0] if ":" in e) == list(range(6))  # each job once
    assert {e.split(":")[0] for e in runs[0] if ":" in e} == {"a", "b"}  # a sleep passes the turn on
    assert runs[0][-1] == "joined"


def test_a_call_ends_only_once_every_helper_waits_again():
    def body(log):
        jobs = queue.SimpleQueue.__new__(thread_hooks.FollowedSimpleQueue)
        done = threading.Event()

        def loop():
            jobs.get()
            log.append("copied")
            done.set()
            jobs.get()  # waits again: the call may end

        threading.Thread(target=loop, daemon=True).start()
        jobs.put("job")
        log.append("returned")

    assert _scheduled(body) == ["returned", "copied"]


def test_a_wait_nobody_can_end_is_a_deadlock_raised_in_the_callers_thread():
    def body(log):
        never = threading.Event()
        threading.Thread(target=lambda: queue.Queue().get(), daemon=True).start()
        never.wait()

    with pytest.raises(TurnDeadlock, match=r"^deadlock: every thread waits for another, none with a timeout "):
        _scheduled(body)


def test_a_tools_own_thread_started_inside_a_turn_is_no_member_and_no_deadlock():
    """The gate watchdog starts lazily, inside the first gated op of the code under test (on a GPU in
    the controlled mode): Thread.start's wait for it to run is the tool's, not a turn."""
    ran = threading.Event()

    def body(log):
        own = threading.Thread(target=ran.set, name="tool", daemon=True)
        own._kvz_own = True
        own.start()
        log.append("started")

    assert _scheduled(body) == ["started"]
    assert ran.wait(5)


def test_a_timed_wait_times_out_only_when_nothing_else_can_run():
    def body(log):
        jobs = queue.Queue()

        def poller():
            while True:
                try:
                    item = jobs.get(timeout=0.5)
                except queue.Empty:
                    log.append("timed out")
                    return
                log.append(f"got {item}")

        t = threading.Thread(target=poller, daemon=True)
        t.start()
        jobs.put(1)
        t.join()

    assert _scheduled(body) == ["got 1", "timed out"]


# -- the fuzzer, on an offloader whose copies a background thread issues (vLLM's SimpleCPUOffload) --
def _config(name: str) -> EpisodeConfig:
    return EpisodeConfig(offloader=f"{EXAMPLES}:{name}")


def test_the_copy_threads_race_replays_the_same_finding_every_time():
    found = [run_ops(_config("copy_thread_without_compute_event"), STORE) for _ in range(5)]
    assert found[0] and found[0][0].kind == "hazard"
    assert all([str(f) for f in run] == [str(f) for f in found[0]] for run in found)
    # the copy the thread issued, on the thread's stream, in the store that fed it (K/V planes into
    # pinned rows: torch passes them through a pageable temporary, so the copy is synchronous)
    assert "copy_ (synchronous)" in str(found[0][0]) and "on stream 'offloader-1'" in str(found[0][0])
    assert "copy_thread_without_compute_event.store#" in str(found[0][0])


def test_an_offloader_whose_wait_can_never_end_is_its_finding_not_a_hang(tmp_path: Path):
    source = tmp_path / "hangs.py"
    source.write_text(
        "import sys, threading\n"
        f"sys.path.insert(0, {str(ROOT / 'examples')!r})\n"
        "from engine_offloaders import CopyThreadOffloader\n"
        "class Hangs(CopyThreadOffloader):\n"
        "    def wait(self, job_ids):\n"
        "        threading.Event().wait()  # nobody sets it\n"
        "def make(cache, host_pool, runtime=None):\n"
        "    return Hangs(cache, host_pool)\n")
    ops = [{"op": "start"}, {"op": "allocate", "n": 1}, {"op": "store", "block": 1}, {"op": "wait", "slot": 1}]
    found = run_ops(EpisodeConfig(offloader=f"{source}:make"), ops)
    assert found and "deadlock: every thread waits for another" in str(found[0])


def test_a_helper_polling_an_event_with_sleeps_sees_the_device_get_there(tmp_path: Path):
    # SGLang's controller threads poll their finish events; on the simulator the device moves only
    # when every thread waits and one waits for a while (racecheck.turns: on_idle)
    source = tmp_path / "poller.py"
    source.write_text(
        "import sys, threading, time\n"
        f"sys.path.insert(0, {str(ROOT / 'examples')!r})\n"
        "import torch\n"
        "from engine_offloaders import CopyThreadOffloader\n"
        "class Polls(CopyThreadOffloader):\n"
        "    def wait(self, job_ids):\n"
        "        done = threading.Event()\n"
        "        def poll():\n"
        "            for _ in range(1000):\n"
        "                if all(end.query() for job, _, end in self.in_flight if job in job_ids):\n"
        "                    done.set()\n"
        "                    return\n"
        "                time.sleep(0.001)\n"
        "        threading.Thread(target=poll, daemon=True).start()\n"
        "        if not done.wait(timeout=60):\n"
        "            raise TimeoutError('the poller never saw the copies complete')\n"
        "def make(cache, host_pool, runtime=None):\n"
        "    return Polls(cache, host_pool)\n")
    ops = [{"op": "start"}, {"op": "allocate", "n": 1}, {"op": "store", "block": 1}, {"op": "wait", "slot": 1}]
    assert run_ops(EpisodeConfig(offloader=f"{source}:make"), ops) == []


def test_the_cuda_runtimes_own_back_off_in_a_helper_thread_passes_no_turn(monkeypatch):
    # A copy thread's synchronous copy polls the GPU in the runtime (kvdevice.runtime.cuda.common);
    # that back-off is the tool's, not the program's sleep: taken as a turn, it let the caller end
    # the call while the helper was inside the runtime (a controlled-mode hang on an H100).
    from types import SimpleNamespace

    from kvdevice.runtime.cuda import common

    monkeypatch.setattr(common, "POLL_SPIN_S", 0.0)  # back off at the first poll
    sleeps: list[str] = []

    class Recording(_Watch):
        def wait_turn(self, obj, condition, timeout):
            if obj is time:
                sleeps.append(threading.current_thread().name)
            return super().wait_turn(obj, condition, timeout)

    turns = Turns()
    thread_hooks.install()
    deactivate = thread_hooks.activate(Recording(turns))
    log: list[str] = []

    def helper():
        until = time.monotonic() + 0.01
        common.CudaRuntimeBase._poll(SimpleNamespace(timeout_s=5.0), lambda: time.monotonic() > until, "an op")
        time.sleep(0)  # the program's own sleep is still a turn
        log.append("polled")

    turns.enter()
    try:
        thread = threading.Thread(target=helper, name="copier", daemon=True)
        thread.start()
        thread.join()
        turns.settle()
    finally:
        turns.leave()
        deactivate()
        turns.close()
    assert log == ["polled"] and sleeps == ["copier"]


def test_a_helper_thread_runs_under_the_same_torch_modes_as_the_call_that_started_it(tmp_path: Path):
    # Torch modes are per thread, so a helper enters its session's modes itself (helper_threads).
    # On CUDA the call also ran under the dispatch mode that routes each op on a CUDA tensor to the
    # runtime, entered apart from the others: a copy thread's copies went straight to a gated stream,
    # unseen, and its synchronous one waited there for a gate nothing opened (an H100 hang).
    source = tmp_path / "modes.py"
    source.write_text(
        "import sys, threading\n"
        f"sys.path.insert(0, {str(ROOT / 'examples')!r})\n"
        "from torch.overrides import _get_current_function_mode_stack\n"
        "from torch.utils._python_dispatch import _get_current_dispatch_mode_stack\n"
        "from engine_offloaders import CopyThreadOffloader\n"
        "import json\n"
        f"OUT = {str(tmp_path / 'seen.json')!r}\n"
        "SEEN = {}\n"
        "def modes():\n"
        "    return [type(m).__name__ for m in (*_get_current_function_mode_stack(), *_get_current_dispatch_mode_stack())]\n"
        "class Records(CopyThreadOffloader):\n"
        "    def store(self, job_id, block_ids, slot_ids):\n"
        "        SEEN['caller'] = modes()\n"
        "        super().store(job_id, block_ids, slot_ids)\n"
        "    def close(self):\n"
        "        super().close()\n"
        "        open(OUT, 'w').write(json.dumps(SEEN))\n"
        "    def _copy_loop(self):\n"
        "        SEEN.setdefault('helper', modes())\n"
        "        super()._copy_loop()\n"
        "def make(cache, host_pool, runtime=None):\n"
        "    return Records(cache, host_pool)\n")
    run_ops(EpisodeConfig(offloader=f"{source}:make"), STORE)
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["caller"] and seen["helper"] == seen["caller"], seen


def test_every_session_mode_is_one_a_helper_thread_enters_the_cuda_dispatch_mode_included():
    from kvdevice.intercept.session import InterceptSession

    session = InterceptSession.__new__(InterceptSession)  # no runtime needed: the list alone
    session.cuda_ops, session.mode = object(), object()
    assert session.modes() == [session.cuda_ops, session.mode]
    session.cuda_ops = None  # the simulator's session: its ops are routed by the function mode
    assert session.modes() == [session.mode]
