"""Ctrl-C, SIGTERM and killed workers: a run stops promptly, fabricates nothing, loses nothing.

* **Signals at random points.** Real ``pytest fuzz`` runs on the simulator (quick profile,
  geometry ``tiny``), serial and with ``-n 2``, get SIGINT or SIGTERM, sent to the process alone
  (``kill PID``) or to its whole process group (Ctrl-C in a terminal), at points drawn from one
  seeded ``random.Random``: during start-up, some time after the first op of the first campaign
  ran (the race-free zeroers are then mid-campaign, the racy ones shrinking), or anywhere. Each
  run is checked by :func:`problems_of`: it exits within :data:`EXIT_WITHIN_S` of the signal, its
  workers too; a race-free zeroer leaves no finding and no trace; every trace a racy one leaves
  replays to a finding; a summary that does not cover every selected campaign says
  ``"partial": true``; a complete ``summary.json`` placed there before the run is byte-identical
  after it unless the run wrote a complete one.
* **Killed workers.** A zeroer that kills its own process mid-episode (``os._exit``, SIGKILL)
  under ``-n 2``: the run exits 1, the summary lists the campaign as crashed, the finding another
  campaign made earlier on the same worker is still in the summary, and the ops the dead worker
  was running are saved as a trace (``--fuzz-journal on``).
* **In process, at every point.** An interruption before each bytecode of the stream queues,
  and at sampled bytecodes of a whole example, leaves the queues usable, judges nothing and gives
  no cut-off episode's cache back to the shared pool.

Most runs are forked from one process that has already imported torch and the plugin
(tests/signal_runs.py says why); the import-time points and the killed-worker runs are plain
``python -m pytest`` subprocesses.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from racecheck import interrupts
from fuzz.engine.campaigns import default_campaigns
from fuzz.engine.summary import render_summary
from fuzz.trace import load_trace
from repro.replay import replay
from tests.signal_runs import Forker, Run, clean_env, dump_stacks, start_subprocess

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="process groups and /proc: Linux")

ROOT = Path(__file__).resolve().parents[1]
SEED = 20261202  # every point below is drawn from random.Random(SEED)
# From the signal to the exit of the run's last process. Measured on the 2-core VM, busy with
# other work: serial runs exit within about 3 s, -n 2 runs within about 4 s.
EXIT_WITHIN_S = 10.0
EXTRA_POINTS = 40  # random bytecodes of one example to interrupt it at in process, beyond one per function
CLEAN = ("event_ring", "per_call", "reference")  # race-free built-ins
RACY = ("ring", "single_buffer")
INTERRUPTED_CODES = {2, -signal.SIGINT, -signal.SIGTERM}  # pytest's "interrupted"; killed before the handlers were in


@dataclass(frozen=True)
class Point:
    """One signalled run."""

    number: int
    xdist: bool
    zeroer: str
    signal: signal.Signals
    to_group: bool  # the whole process group (Ctrl-C in a terminal) or the pytest process alone
    phase: str  # PHASES: when delay_s starts to count
    delay_s: float
    journal: bool
    prior_summary: bool  # a complete summary.json is there before the run
    forked: bool  # from the Forker; False: a plain python -m pytest subprocess

    @property
    def racy(self) -> bool:
        return self.zeroer in RACY

    def describe(self) -> str:
        to = "group" if self.to_group else "process"
        return (f"point {self.number}: {'-n 2' if self.xdist else 'serial'}, {self.zeroer}, {self.signal.name} to the {to}, "
                f"{self.phase} + {self.delay_s:.2f} s, journal {'on' if self.journal else 'off'}, "
                f"{'forked' if self.forked else 'python -m pytest'}{', prior summary' if self.prior_summary else ''}")


# When a point's delay starts: at the start of the process ("start-up"); when pytest prints the
# campaign file's name as the first campaign starts ("mid-campaign", "shrinking": a racy zeroer
# finds its race within about 0.1 s of its campaign and shrinks it for a second or two after);
# when the journal names the second campaign, so the first has ended ("second-campaign"); when
# the first op of any worker was journalled ("mid-run", under -n 2).
SERIAL_PHASES = ["start-up"] * 10 + ["mid-campaign"] * 10 + ["second-campaign"] * 8 + ["shrinking"] * 14
XDIST_PHASES = ["start-up"] * 3 + ["mid-run"] * 5
DELAYS_S = {"start-up": (0.0, 1.0), "mid-campaign": (0.0, 2.0), "second-campaign": (0.0, 1.5),
            "shrinking": (0.1, 1.5), "mid-run": (0.0, 3.0)}
JOURNALLED = ("second-campaign", "mid-run")  # phases seen through the journal: --fuzz-journal on
PLAIN_START_UP_S = (0.0, 3.0)  # a plain python -m pytest spends its first seconds importing
XDIST_START_UP_S = (1.0, 6.0)  # the controller starting its workers, they importing and collecting


def draw_points(rng: random.Random, phases: list[str], *, xdist: bool, first: int, plain: int) -> list[Point]:
    """One point per phase, in a shuffled order; the first ``plain`` are plain subprocesses."""
    phases = list(phases)
    rng.shuffle(phases)
    points = []
    for i, phase in enumerate(phases):
        forked = i >= plain
        low, high = DELAYS_S[phase]
        if phase == "start-up":
            low, high = XDIST_START_UP_S if xdist else (DELAYS_S[phase] if forked else PLAIN_START_UP_S)
        points.append(Point(
            number=first + i, xdist=xdist, zeroer=rng.choice(RACY if phase == "shrinking" else CLEAN + RACY),
            signal=rng.choice((signal.SIGINT, signal.SIGTERM)), to_group=rng.random() < 0.5, phase=phase,
            delay_s=round(rng.uniform(low, high), 3),
            journal=phase in JOURNALLED or (phase != "shrinking" and rng.random() < 0.5),
            prior_summary=rng.random() < 0.5, forked=forked,
        ))
    return points


def selected(point: Point) -> set[str]:
    """The campaign ids the run's ``-k`` selects (two, or three with the x2 campaign under -n 2)."""
    return {c.id for c, skipped in default_campaigns(["sim"], point.zeroer)
            if skipped is None and "tiny" in c.id and "triton" not in c.id and (point.xdist or "-x2-" not in c.id)}


def pytest_args(point: Point, run_dir: Path) -> list[str]:
    k = "tiny and not triton" + ("" if point.xdist else " and not x2")
    return [
        # Default verbosity: the campaign file's name is printed (and flushed) as its first campaign starts.
        "fuzz", "-p", "no:cacheprovider", "-W", "ignore::pytest.PytestAssertRewriteWarning",
        *(["-n", "2"] if point.xdist else ["-p", "no:xdist"]),
        "--backend", "sim", "--fuzz-profile", "quick", "--zeroer", point.zeroer, "-k", k,
        "--fuzz-journal", "on" if point.journal else "off", "--repro-dir", str(run_dir / "traces"),
        "--fuzz-summary", str(run_dir / "summary.json"), "--fuzz-db", str(run_dir / "db"),
    ]


def reached(point: Point, run: Run, run_dir: Path, seen: set[str]) -> bool:
    """Whether the run has reached the moment its point's delay counts from."""
    journals = list((run_dir / "traces").glob(".inflight-*.json"))
    if point.phase == "mid-run":
        return bool(journals)
    if point.phase == "second-campaign":
        for journal in journals:
            try:
                seen.add(json.loads(journal.read_text())["campaign"])
            except (OSError, ValueError, KeyError):  # replaced while read
                pass
        return len(seen) > 1
    return "test_campaigns.py" in run.text()


@dataclass
class Outcome:
    point: Point
    run_dir: Path
    run: Run
    signalled_at: float | None  # time.monotonic(); None: the run had ended before its point came
    code: int | None = None
    exited_at: float | None = None
    group_gone_at: float | None = None
    prior: bytes | None = None
    stacks: str = ""  # where its processes were when it was late to exit (tests.signal_runs.dump_stacks)


def complete_summary() -> bytes:
    _, data = render_summary([], "quick", partial=False)
    return (json.dumps(data, indent=1) + "\n").encode()


def play(point: Point, run_dir: Path, forker: Forker, stacks: Path) -> Outcome:
    """Start the run, send the signal at its point, wait for every process of it to exit."""
    run_dir.mkdir(parents=True)
    prior = None
    if point.prior_summary:
        prior = complete_summary()
        (run_dir / "summary.json").write_bytes(prior)
    args, output = pytest_args(point, run_dir), run_dir / "output.txt"
    run = forker.start(args, output) if point.forked else start_subprocess(ROOT, clean_env(ROOT, stacks), args, output)
    started = time.monotonic()
    outcome = Outcome(point, run_dir, run, None, prior=prior)
    if point.phase != "start-up":
        seen: set[str] = set()
        while not reached(point, run, run_dir, seen) and run.wait(0.02) is None and time.monotonic() - started < 180:
            pass
        started = time.monotonic()
    if run.wait(max(0.0, started + point.delay_s - time.monotonic())) is None:
        outcome.signalled_at = time.monotonic()
        send = os.killpg if point.to_group else os.kill
        try:
            send(run.pid, point.signal)
        except ProcessLookupError:
            outcome.signalled_at = None
    ended = run.wait(EXIT_WITHIN_S + 1)
    if outcome.signalled_at is not None and (ended is None or run.group_alive()):
        outcome.stacks = dump_stacks(run, stacks)  # late: say where it is, and go on waiting
    if ended is None:
        ended = run.wait(60)  # more than allowed, so a slow exit is measured, not killed
    if ended is None:
        run.kill_group()
        ended = run.wait(30) or (None, None)
    outcome.code, outcome.exited_at = ended
    deadline = time.monotonic() + EXIT_WITHIN_S + 30
    while run.group_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    outcome.group_gone_at = time.monotonic()
    if run.group_alive():
        run.kill_group()
    return outcome


# CPython's report of an exception it could not raise, when that exception is a KeyboardInterrupt
# with no message: Python's own SIGINT handler's (ours says "stopped by SIGINT").
DROPPED = re.compile(r"^Exception ignored in: .*\n(?:.+\n)*?KeyboardInterrupt: ?$", re.MULTILINE)


def dropped_by_python(point: Point, text: str) -> bool:
    """Whether Python dropped the point's SIGINT before the plugin was imported.

    Until the plugin's handlers are in, a SIGINT is Python's: a KeyboardInterrupt raised wherever
    the main thread is. When that is a weakref callback of the import machinery, CPython prints
    "Exception ignored in: ..." and drops it, and the run goes on as if it had not been signalled
    (a second Ctrl-C stops it). Only a plain process has that window, its first fraction of a
    second; a forked run inherits the handlers of the process it was forked from."""
    return not point.forked and point.signal == signal.SIGINT and DROPPED.search(text) is not None


def problems_of(outcome: Outcome) -> list[str]:
    """Everything wrong with one signalled run (empty: it behaved)."""
    point, run_dir, problems = outcome.point, outcome.run_dir, []
    text = outcome.run.text()
    code = outcome.code
    # A signal Python dropped: judged as the run it went on to be, one that was never signalled.
    signalled_at = None if dropped_by_python(point, text) else outcome.signalled_at
    interrupted = signalled_at is not None and outcome.exited_at is not None and outcome.exited_at >= signalled_at
    if signalled_at is not None:
        if outcome.exited_at is None or outcome.exited_at - signalled_at > EXIT_WITHIN_S:
            problems.append(f"the run did not exit within {EXIT_WITHIN_S} s of the signal "
                            f"({None if outcome.exited_at is None else round(outcome.exited_at - signalled_at, 1)} s)")
        if outcome.group_gone_at - signalled_at > EXIT_WITHIN_S + 0.5:
            problems.append(f"processes of the run were still alive {outcome.group_gone_at - signalled_at:.1f} s "
                            f"after the signal")
    allowed = ({1} if point.racy else {0}) | (INTERRUPTED_CODES | ({1} if point.racy else set()) if interrupted else set())
    if code not in allowed:
        problems.append(f"exit status {code}, expected one of {sorted(allowed)}")
    if "INTERNALERROR" in text:
        problems.append("pytest reported an internal error")
    if not point.racy and re.search(r"\d+ (failed|errors?)\b", text):
        problems.append("a race-free zeroer's run reported a failed test")

    # Traces: none from a race-free zeroer; every one from a racy zeroer replays to a finding.
    traces = trace_files(run_dir)
    if traces and not point.racy:
        problems.append(f"a race-free zeroer left traces: {[p.name for p in traces]}")

    # Summaries.
    expected = selected(point)
    summary, beside = run_dir / "summary.json", run_dir / "summary.partial.json"
    written = []
    if summary.exists() and summary.read_bytes() != outcome.prior:
        written.append(summary)
    if beside.exists():
        written.append(beside)
    if outcome.prior is not None and summary.read_bytes() != outcome.prior:
        data = json.loads(summary.read_text())
        if data["totals"]["partial"]:
            problems.append("a partial summary replaced the complete summary.json that was there")
    if code in ({0, 1} - (INTERRUPTED_CODES if interrupted else set())) and not interrupted and not written:
        problems.append("a run that ended by itself wrote no summary")
    for path in written:
        data = json.loads(path.read_text())
        done = {r["campaign"] for r in data["campaigns"]}
        covered = done | set(data["not_run"]) | set(data["crashed"])
        if data["crashed"]:
            problems.append(f"{path.name} lists crashes: {data['crashed']} (an interruption is not a crash)")
        if covered != expected:
            problems.append(f"{path.name} accounts for {sorted(covered)}, the run selected {sorted(expected)}")
        if not data["totals"]["partial"] and done != expected:
            problems.append(f"{path.name} is not marked partial but has results for {sorted(done)} only")
        if path == beside and not data["totals"]["partial"]:
            problems.append("summary.partial.json is not marked partial")
        for record in data["campaigns"]:
            if record["found"] and not point.racy:
                problems.append(f"{path.name}: a finding for race-free {record['campaign']}")
            if record["found"] and (record["trace"] is None or Path(record["trace"]) not in traces):
                problems.append(f"{path.name}: {record['campaign']}'s trace {record['trace']} was not written")
    return problems


TRACE_NAME = re.compile(r"^[^.]+-[0-9a-f]{16}\.json$")  # fuzz.engine.trace.trace_name: <zeroer>-<geometry>-<hash>.json


def trace_files(run_dir: Path) -> list[Path]:
    """The trace files of a run's --repro-dir (not the in-flight journal, not what is drawn beside them)."""
    return sorted(p for p in (run_dir / "traces").glob("*.json") if TRACE_NAME.match(p.name))


def replay_problems(outcome: Outcome) -> list[str]:
    """Every trace of a racy run must replay to a finding (on the simulator: deterministically)."""
    problems = []
    for path in trace_files(outcome.run_dir):
        trace = load_trace(path)
        shown, _, _ = replay(trace.config, trace.ops)
        if not shown:
            problems.append(f"{path.name} does not replay to a finding")
    return problems


def saved_at_interruption(outcome: Outcome) -> bool:
    """A trace that no campaign result names: written because the run was cut off after a finding."""
    traces = set(trace_files(outcome.run_dir))
    named = set()
    for path in (outcome.run_dir / "summary.json", outcome.run_dir / "summary.partial.json"):
        if path.exists() and path.read_bytes() != outcome.prior:
            named |= {Path(r["trace"]) for r in json.loads(path.read_text())["campaigns"] if r["trace"]}
    return bool(traces - named)


def play_all(points: list[Point], tmp_path: Path, concurrency: int) -> list[Outcome]:
    stacks = tmp_path / "stacks"
    forker = Forker(ROOT, clean_env(ROOT, stacks))
    try:
        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(lambda p: play(p, tmp_path / f"point{p.number}", forker, stacks), points))
    finally:
        forker.close()


def check_all(outcomes: list[Outcome]) -> None:
    failures = []
    for outcome in outcomes:
        problems = problems_of(outcome) + (replay_problems(outcome) if outcome.point.racy else [])
        if problems:
            tail = "\n    ".join(outcome.run.text().splitlines()[-12:])
            stacks = "\n    ".join(outcome.stacks.splitlines()[:200])
            failures.append(f"{outcome.point.describe()}: exit {outcome.code}\n  - " + "\n  - ".join(problems)
                            + f"\n  output:\n    {tail}"
                            + (f"\n  its processes {EXIT_WITHIN_S + 1:.0f} s after the signal:\n    {stacks}" if stacks else ""))
    signalled = [o for o in outcomes if o.signalled_at is not None and o.exited_at and o.exited_at >= o.signalled_at]
    assert not failures, "\n".join(failures)
    # Most points must have cut a live run off (a point after the run's end tests nothing).
    assert len(signalled) >= 0.8 * len(outcomes), f"only {len(signalled)} of {len(outcomes)} runs were still running at their point"


def test_a_signal_at_a_random_point_of_a_serial_run_stops_it_promptly_and_fabricates_nothing(tmp_path):
    points = draw_points(random.Random(SEED), SERIAL_PHASES, xdist=False, first=0, plain=2)
    outcomes = play_all(points, tmp_path, concurrency=4)
    check_all(outcomes)
    # Some racy run was cut off after its finding and before its campaign ended (while shrinking):
    # the finding was still saved, and replayed above.
    assert any(saved_at_interruption(o) for o in outcomes), "no point landed after a finding and before its campaign ended"
    # and some run was cut off after a campaign had ended: it wrote a partial summary, beside a complete one
    assert any((o.run_dir / "summary.partial.json").exists() for o in outcomes), "no run wrote a partial summary"


def test_a_signal_at_a_random_point_of_an_xdist_run_stops_it_and_its_workers_promptly(tmp_path):
    points = draw_points(random.Random(SEED + 1), XDIST_PHASES, xdist=True, first=len(SERIAL_PHASES), plain=1)
    check_all(play_all(points, tmp_path, concurrency=2))


def test_a_late_run_says_where_each_of_its_processes_is_and_goes_on(tmp_path):
    """What check_all shows for a run that is late to exit: every thread's stack, of every process
    of its group, the run left running."""
    stacks = tmp_path / "stacks"
    waiter = tmp_path / "waiter.py"
    waiter.write_text("import subprocess, sys, time\n"
                      "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                      "def waiting_for_the_child():\n    child.wait()\n"
                      "waiting_for_the_child()\n")
    handle = open(tmp_path / "output.txt", "w")
    process = subprocess.Popen([sys.executable, str(waiter)], env=clean_env(ROOT, stacks), stdout=handle,
                               stderr=subprocess.STDOUT, start_new_session=True)
    handle.close()
    run = Run(process.pid, tmp_path / "output.txt", lambda timeout: None)
    try:
        deadline = time.monotonic() + 60
        while len(run.group_alive()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # both past their imports
        text = dump_stacks(run, stacks)
        assert text.count("--- process ") == 2, text
        assert "in waiting_for_the_child" in text and "Current thread" in text, text
        assert process.poll() is None, "SIGUSR1 stopped the run"
    finally:
        run.kill_group()
        process.wait()


# -- workers killed mid-episode ------------------------------------------------------------------

KILLER = '''
import glob
import os
import signal
import time

from zeroer.designs import PerCallZeroer
from zeroer.registry import make_zeroer

TRACES = {traces!r}


class Crasher(PerCallZeroer):
    """Dies as a worker hit by a CUDA fault or the OOM killer does: on its first call after the
    warm-up, once the other campaign of the run has found its race."""

    def zero_block_ids(self, block_ids):
        if list(block_ids) != [0]:
            deadline = time.monotonic() + 120
            while not glob.glob(os.path.join(TRACES, "killer_py_make-ratio2-*.json")) and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)  # and its result on its way to the controller
            {kill}
        super().zero_block_ids(block_ids)


def make(cache, runtime):
    if cache.spec.name == "ratio2":  # the other campaign: the racy built-in single_buffer, found at once
        return make_zeroer("single_buffer", cache, runtime, kernel="torch")
    return Crasher(cache, runtime, kernel="torch")


make.capabilities = Crasher.capabilities  # a runtime-API zeroer: not intercepted
'''


@pytest.mark.parametrize("kill", ["os._exit(3)", "os.kill(os.getpid(), signal.SIGKILL)"], ids=["os_exit", "sigkill"])
def test_a_worker_killed_mid_episode_is_a_crash_and_loses_no_earlier_finding(tmp_path, kill):
    traces, summary = tmp_path / "traces", tmp_path / "summary.json"
    (tmp_path / "killer.py").write_text(KILLER.replace("{traces!r}", repr(str(traces))).replace("{kill}", kill))
    # Two campaigns, one per worker: ratio2 runs the racy single_buffer, tiny the killer, which
    # dies once the ratio2 campaign's trace is written.
    args = ["fuzz", "-q", "-p", "no:cacheprovider", "-n", "2", "--backend", "sim", "--fuzz-profile", "quick",
            "--zeroer", f"{tmp_path / 'killer.py'}:make", "--geometry", "ratio2,tiny", "-k", "shard0 and not x2",
            "--fuzz-journal", "on", "--repro-dir", str(traces), "--fuzz-summary", str(summary),
            "--fuzz-db", str(tmp_path / "db")]
    run = start_subprocess(ROOT, clean_env(ROOT), args, tmp_path / "output.txt")
    code, _ = run.wait(300) or (None, None)
    output = run.text()
    assert code == 1, output
    crashed, racy = "killer.py:make-tiny-sim-shard0", "killer.py:make-ratio2-sim-shard0"
    # Once in the failure section (pytest's short summary repeats it, whole where CI is set)
    reported = [line for line in output.splitlines()
                if line.startswith("worker ") and f"crashed while running 'fuzz/test_campaigns.py::test_campaign[{crashed}]'" in line]
    assert len(reported) == 1, output
    data = json.loads(summary.read_text())
    assert data["crashed"] == [crashed] and data["totals"]["crashed"] == 1 and not data["totals"]["partial"]
    assert crashed not in {r["campaign"] for r in data["campaigns"]}  # a crash is never reported clean
    (found,) = [r for r in data["campaigns"] if r["campaign"] == racy]
    assert found["found"] and Path(found["trace"]).exists()
    trace = load_trace(Path(found["trace"]))
    assert replay(trace.config, trace.ops)[0] == 1
    rescued = re.search(r"the ops it was running are saved in (\S+)", output)
    assert rescued, output
    data = json.loads(Path(rescued.group(1)).read_text())
    assert data["campaign"] == crashed and data["findings"][0]["kind"] == "crash" and data["ops"][-1]["op"] == "allocate"


# -- in process: an interruption at every point ---------------------------------------------------

def _interrupt_at(n: int, files: tuple[str, ...], fn, where: list[str] | None = None, on_fire=None) -> bool:
    """Run ``fn()``, raising KeyboardInterrupt before the ``n``-th bytecode it executes in
    ``files``, as a signal handler would (``interrupted()`` set first); True if that happened.
    Other exceptions pass through; ``where`` gets the function of every bytecode seen (n=0: none
    raised, a dry run); ``on_fire()`` is called just before the interruption."""
    count = 0
    wanted = frozenset(files)

    def bytecode(code) -> None:
        nonlocal count
        count += 1
        if where is not None:
            where.append(code.co_qualname)
        if count == n:
            if on_fire is not None:
                on_fire()
            interrupts.mark_interrupted()
            raise KeyboardInterrupt("stopped by the test")

    try:
        with _each_bytecode(wanted, bytecode):
            fn()
    except KeyboardInterrupt:
        return count >= n > 0
    finally:
        interrupts.reset()
    return False


@contextlib.contextmanager
def _each_bytecode(files: frozenset[str], seen):
    """Call ``seen(code)`` before every bytecode executed in ``files`` by the thread that entered;
    what it raises is raised there.

    Python 3.12 never delivers the ``opcode`` events that ``f_trace_opcodes`` asks ``sys.settrace``
    for (seen on 3.12.1 here and 3.12.3 on the H200: no event at all, so these tests interrupted
    nothing), so there it is ``sys.monitoring``'s INSTRUCTION event; elsewhere opcode tracing.

    Only the entering thread's bytecodes count. ``sys.monitoring`` fires for every thread, and
    other threads run code of these files too (racecheck/gate.py's watchdog): counting theirs made
    the interruption land in the watchdog instead of the code under test (once on the H200, under
    3.12), and would make the n-th bytecode depend on thread scheduling. ``sys.settrace`` traces
    only the thread that set it; the check there says the same thing in the same words."""
    owner = threading.get_ident()
    if sys.version_info[:2] == (3, 12):
        monitoring = sys.monitoring
        tool = monitoring.DEBUGGER_ID

        def on_instruction(code, offset):
            if code.co_filename not in files:
                # Not ours, whichever thread runs it: never called for this instruction again.
                return monitoring.DISABLE
            if threading.get_ident() != owner:
                # Ours, but another thread's. Not DISABLE: that turns the instruction off for
                # every thread, the entering one included.
                return None
            seen(code)
            return None

        monitoring.use_tool_id(tool, "test_interrupts")
        monitoring.register_callback(tool, monitoring.events.INSTRUCTION, on_instruction)
        monitoring.set_events(tool, monitoring.events.INSTRUCTION)
        try:
            yield
        finally:
            monitoring.set_events(tool, 0)
            monitoring.register_callback(tool, monitoring.events.INSTRUCTION, None)
            monitoring.free_tool_id(tool)
            monitoring.restart_events()  # the next run sees every instruction again
        return

    def local(frame, event, arg):
        if event == "opcode":
            seen(frame.f_code)
        return local

    def calls(frame, event, arg):
        if frame.f_code.co_filename in files and threading.get_ident() == owner:
            frame.f_trace_opcodes = True
            return local
        return None

    sys.settrace(calls)
    try:
        yield
    finally:
        sys.settrace(None)


def _spin(n: int) -> int:
    """A few bytecodes of this file, for a thread to run."""
    total = 0
    for i in range(n):
        total += i
    return total


def test_only_the_bytecodes_of_the_thread_that_entered_are_counted():
    # Another thread runs code of a watched file while the count is on (as racecheck/gate.py's
    # watchdog does during an example): none of its bytecodes is counted, and the same code run
    # afterwards by the entering thread still is (on 3.12, a DISABLE for the other thread's
    # instructions would have turned them off for this one too).
    counted: list[tuple[int, str]] = []
    done: list[int] = []

    def seen(code) -> None:
        counted.append((threading.get_ident(), code.co_name))

    def both() -> None:
        other = threading.Thread(target=lambda: done.append(_spin(50)))
        other.start()
        other.join()
        _spin(50)

    with _each_bytecode(frozenset({__file__}), seen):
        both()
    assert done == [_spin(50)]  # the other thread ran the watched code while the count was on
    assert {thread for thread, _ in counted} == {threading.get_ident()}, counted
    assert "_spin" in {name for _, name in counted}, counted
    # And an interruption lands in the entering thread, even at a bytecode the other thread's
    # would have outnumbered: the first of its own _spin, after the other thread's whole _spin.
    where: list[str] = []
    _interrupt_at(0, (__file__,), both, where)
    assert _interrupt_at(where.index("_spin") + 1, (__file__,), both)


def test_the_stream_queues_stay_consistent_whichever_bytecode_an_interruption_lands_on():
    # The old bug: Ctrl-C between taking an op off its queue and counting it executed left a
    # count the queue disagreed with, and the next synchronisation raised IndexError.
    from kvdevice.runtime import queues
    from kvdevice.runtime.queues import QueuedOp, StreamQueues

    def build():
        q = StreamQueues(execute=lambda op: None)
        return q, q.add_stream("a"), q.add_stream("b")

    def program(q, a, b):
        q.enqueue(a, QueuedOp("kernel", "k1"))
        position = q.enqueue(a, QueuedOp("record", "e1"))
        q.enqueue(b, QueuedOp("wait", "w1", wait_for=(a, position)))
        q.enqueue(b, QueuedOp("sleep", "s1", remaining=2))
        q.enqueue(b, QueuedOp("kernel", "k2"))
        q.advance(a, 1)
        q.run_until(b, 3)
        q.drain_all()

    points = 0
    while True:
        q, a, b = build()
        if not _interrupt_at(points + 1, (queues.__file__,), lambda: program(q, a, b)):
            break
        points += 1
        q.drain_all()  # what closing the runtime does: it must neither raise nor lose count
        assert [q.pending(s) for s in (a, b)] == [0, 0]
        assert q.executed == q.enqueued and all(q.completed(s, q.enqueued[s]) for s in (a, b))
    assert points > 500  # every bytecode of the program, one run each


@pytest.mark.parametrize("zeroer", ["reference", "single_buffer"])
def test_an_example_interrupted_anywhere_is_never_judged_and_its_caches_never_pooled(monkeypatch, zeroer):
    # reference ends clean (teardown judges it, closes it and pools its caches); single_buffer
    # ends at the hazard of its third zero call (the episode is abandoned there).
    import fuzz.engine.machine as machine_module
    from fuzz.engine.cache_pool import CachePool
    from fuzz.engine.episode import EpisodeConfig, run_ops
    from fuzz.engine.machine import machine_for
    from fuzz.engine.violation import ZeroerViolation

    files = tuple(str(p) for p in (ROOT / "fuzz").rglob("*.py")) + tuple(str(p) for p in (ROOT / "zeroer").rglob("*.py"))
    kernel = "torch" if zeroer != "reference" else None
    machine_class = machine_for(EpisodeConfig(zeroer=zeroer, kernel=kernel), f"{zeroer}_interrupted")
    state: dict = {}

    def example() -> None:
        machine = state["machine"] = machine_class()
        try:
            machine.start(in_flight=2, disabled=frozenset())
            (block,) = machine.allocate_blocks(n=1, stream=0).values
            machine.write_block(block=block, stream=1)
            machine.read_block(block=block, stream=2)
            machine.advance_stream(stream=0, ops=2)
            machine.allocate_blocks(n=2, stream=0)
        finally:
            machine.teardown()

    def pooled(pool: CachePool) -> int:
        return sum(len(caches) for caches in pool._free.values())

    def run_one(n: int, where: list[str] | None = None) -> tuple[bool, BaseException | None]:
        pool = CachePool()
        monkeypatch.setattr(machine_module, "_CACHES", pool)
        state.clear()
        state["pool"] = pool

        def on_fire() -> None:
            state["pooled_before"] = pooled(pool)

        try:
            return _interrupt_at(n, files, example, where, on_fire), None
        except BaseException as raised:  # noqa: BLE001 - what escaped is what the test checks
            return False, raised

    where: list[str] = []
    _, error = run_one(0, where)
    total = len(where)
    if zeroer == "reference":  # not interrupted: clean, and its cache went back to the pool
        assert error is None and pooled(state["pool"]) == 1
    else:  # not interrupted: the race is found
        assert isinstance(error, ZeroerViolation) and pooled(state["pool"]) == 0
    # One bytecode in every function the example runs (Episode.close, Runtime.synchronize, the
    # zeroer's calls, the oracle...), and more at random.
    rng = random.Random(SEED)
    by_function: dict[str, list[int]] = {}
    for index, function in enumerate(where, 1):
        by_function.setdefault(function, []).append(index)
    points = {rng.choice(indices) for indices in by_function.values()} | set(rng.sample(range(1, total + 1), EXTRA_POINTS))
    for n in sorted(points):
        fired, error = run_one(n)
        assert fired and error is None, f"bytecode {n} of {total}: {error!r} escaped instead of KeyboardInterrupt"
        pool = state["pool"]
        assert pooled(pool) == state["pooled_before"], f"bytecode {n} of {total}: a cache was pooled after the interruption"
        # Whatever the interruption left in the pool serves the next example as a fresh cache would.
        ops = [{"op": "start", "in_flight": 1}, {"op": "allocate", "n": 2, "stream": 1}]
        assert run_ops(EpisodeConfig(zeroer="reference"), ops, caches=pool) == []


def test_ctrl_c_before_any_campaign_ended_writes_a_partial_summary_of_what_did_not_run(tmp_path):
    """Interrupted in its first campaign, a run still says what it was to run (all of it not
    run), beside the complete summary already there, never over it."""
    summary, prior = tmp_path / "summary.json", complete_summary()
    summary.write_bytes(prior)
    args = ["fuzz", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", "--backend", "sim", "--zeroer", "per_call",
            "--geometry", "tiny", "-k", "k-torch and not x2", "--fuzz-profile", "nightly", "--fuzz-minutes", "2",
            "--fuzz-journal", "on", "--repro-dir", str(tmp_path / "traces"), "--fuzz-summary", str(summary),
            "--fuzz-db", str(tmp_path / "db")]
    run = start_subprocess(ROOT, clean_env(ROOT), args, tmp_path / "output.txt")
    deadline = time.monotonic() + 120
    while not list((tmp_path / "traces").glob(".inflight-*.json")) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(run.pid, signal.SIGINT)
    code, _ = run.wait(EXIT_WITHIN_S) or (None, None)
    assert code == 2, run.text()
    assert summary.read_bytes() == prior
    data = json.loads((tmp_path / "summary.partial.json").read_text())
    assert data["totals"]["partial"] and data["campaigns"] == [] and data["crashed"] == []
    assert data["not_run"] == ["per_call-tiny-sim-k-torch-shard0", "per_call-tiny-sim-k-torch-shard1"]
    assert not trace_files(tmp_path)  # nothing found, no trace written


SIGNAL_IN_COLLECTION = """
import os
import signal

import pytest


@pytest.hookimpl(tryfirst=True)  # before -k deselects anything
def pytest_collection_modifyitems(items):
    os.kill(os.getpid(), signal.SIGINT)
"""


def test_ctrl_c_before_k_has_deselected_counts_no_campaign_as_the_runs(tmp_path):
    """pytest reports the end of collection even when a signal cut it off, with every item it had
    collected: a partial summary written from that list put the campaigns -k was about to drop
    among "not run" (seen in CI: a SIGINT 0.62 s after start-up). The run had selected nothing."""
    (tmp_path / "signal_in_collection.py").write_text(SIGNAL_IN_COLLECTION)
    env = clean_env(ROOT)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    summary = tmp_path / "summary.json"
    args = [sys.executable, "-m", "pytest", "fuzz", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
            "-p", "signal_in_collection", "--backend", "sim", "--zeroer", "per_call", "--geometry", "tiny",
            "-k", "k-torch and shard0 and not x2", "--repro-dir", str(tmp_path / "traces"),
            "--fuzz-summary", str(summary)]
    run = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stdout + run.stderr
    for path in (summary, tmp_path / "summary.partial.json"):
        if path.exists():
            data = json.loads(path.read_text())
            assert set(data["not_run"]) <= {"per_call-tiny-sim-k-torch-shard0"}, data["not_run"]
    assert not trace_files(tmp_path)


INTERRUPTER = """
import os
import signal
import sys

from zeroer.designs import SingleBufferZeroer

CALLS = [0]
MINIMIZER = os.path.join("fuzz", "engine", "minimize.py")


def shrinking():
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code.co_filename.endswith(MINIMIZER):
            return True
        frame = frame.f_back
    return False


class InterruptingSingleBuffer(SingleBufferZeroer):
    \"\"\"single_buffer's race (found within a few examples), and Ctrl-C to the whole run, its
    process group, at its 10th call while the finding is shrunk in this process.\"\"\"

    def zero_block_ids(self, block_ids):
        if shrinking():
            CALLS[0] += 1
            if CALLS[0] == 10:
                os.killpg(os.getpgrp(), signal.SIGINT)
        super().zero_block_ids(block_ids)


def make(cache, runtime):
    return InterruptingSingleBuffer(cache, runtime, kernel="torch")


make.capabilities = InterruptingSingleBuffer.capabilities
"""


def test_ctrl_c_after_a_worker_found_something_reports_the_saved_finding_and_exits_1(tmp_path):
    """Under -n 2 the worker that was cut off after a finding saves its program so far, but its
    note on the interruption never reaches the controller: the controller's summary still names
    the trace, and a finding on a zeroer that must be clean makes the run exit 1, not 2."""
    (tmp_path / "interrupter.py").write_text(INTERRUPTER)
    summary = tmp_path / "summary.json"
    args = ["fuzz", "-q", "-n", "2", "-p", "no:cacheprovider", "--backend", "sim",
            "--zeroer", f"{tmp_path / 'interrupter.py'}:make", "--geometry", "tiny", "-k", "not x2",
            "--fuzz-profile", "nightly", "--fuzz-minutes", "5", "--repro-dir", str(tmp_path / "traces"),
            "--fuzz-summary", str(summary), "--fuzz-db", str(tmp_path / "db")]
    run = start_subprocess(ROOT, clean_env(ROOT), args, tmp_path / "output.txt")
    code, _ = run.wait(240) or (None, None)
    text = run.text()
    assert code == 1, text
    data = json.loads(summary.read_text())
    saved = data["saved_at_interruption"]
    assert data["totals"]["partial"] and saved and data["totals"]["unexpected"] >= len(saved), data
    for entry in saved:
        assert entry["expect"] == "clean" and entry["campaign"] in data["not_run"]
        assert f"{entry['campaign']}: VIOLATION before the interruption" in text
        trace = load_trace(Path(entry["trace"]))
        assert trace.campaign == entry["campaign"] and replay(trace.config, trace.ops)[0]


# A SIGINT that lands in a weakref callback, where CPython cannot raise: the KeyboardInterrupt is
# printed as "Exception ignored" and dropped.
DROPPED_IN_A_CALLBACK = """
import os, signal, sys, weakref
from racecheck import interrupts
if sys.argv[1].startswith("plugin"):
    import fuzz.plugin
    if sys.argv[1] == "plugin":
        interrupts.started()  # pytest_configure: past start-up

class Held:
    pass

def callback(_):
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(10**6):  # Python runs the handler here, inside the callback
        pass

held = Held()
ref = weakref.ref(held, callback)
del held
print("interrupted:", interrupts.interrupted())
"""


@pytest.mark.parametrize("imported, marked", [("plugin", True), ("nothing", False)])
def test_a_sigint_python_drops_still_marks_the_run_interrupted_once_the_plugin_is_imported(imported, marked):
    result = subprocess.run([sys.executable, "-c", DROPPED_IN_A_CALLBACK, imported], cwd=ROOT, env=clean_env(ROOT),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Exception ignored" in result.stderr and "KeyboardInterrupt" in result.stderr
    assert result.stdout.strip() == f"interrupted: {marked}"
    # The test harness tells Python's own dropped interrupt (no message) from the plugin's.
    point = Point(0, False, "ring", signal.SIGINT, False, "start-up", 0.1, False, False, forked=False)
    assert dropped_by_python(point, result.stderr) is (not marked)


def test_a_sigint_in_a_callback_while_the_plugin_starts_up_ends_the_process_by_the_signal():
    """Before pytest_configure nothing has run: the signal ends the process, dropped nowhere."""
    result = subprocess.run([sys.executable, "-c", DROPPED_IN_A_CALLBACK, "plugin-starting"], cwd=ROOT,
                            env=clean_env(ROOT), capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGINT and result.stdout == "", result


BROKEN_BY_THE_SIGNAL = """
import pytest

from racecheck import interrupts


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    # As a signal can: the run is interrupted, and the campaign it cut off fails on its way out
    # with an error that is no verdict on the zeroer.
    interrupts.mark_interrupted()
    yield
    raise RuntimeError("broken by the signal on its way out")
"""


def test_a_campaign_the_signal_broke_is_no_finding_and_the_run_exits_as_interrupted(tmp_path):
    # Seen once in 40 signalled runs of a race-free zeroer (the random-point test): "1 failed",
    # no finding in the summary, and exit 1, the status of a finding.
    (tmp_path / "broken_by_the_signal.py").write_text(BROKEN_BY_THE_SIGNAL)
    env = clean_env(ROOT)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    args = [sys.executable, "-m", "pytest", "fuzz", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
            "-p", "broken_by_the_signal", "--backend", "sim", "--zeroer", "per_call", "--geometry", "tiny",
            "-k", "k-torch and shard0 and not x2", "--repro-dir", str(tmp_path / "traces"),
            "--fuzz-summary", str(tmp_path / "summary.json")]
    run = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "1 failed" in run.stdout and not trace_files(tmp_path)


def test_a_library_that_fails_after_the_signal_landed_in_it_makes_an_interruption_not_a_failure(tmp_path, monkeypatch):
    # Seen once in CI: SIGTERM 0.74 s into a serial run of the race-free reference zeroer, and
    # Hypothesis's stateful runner raised a bare AssertionError on its way out, which failed the
    # campaign ("a race-free zeroer's run reported a failed test").
    from fuzz.engine import campaigns
    from fuzz.engine.episode import EpisodeConfig

    def broken_by_the_signal(*args, **kwargs):
        interrupts.mark_interrupted()
        raise AssertionError

    monkeypatch.setattr(campaigns, "run_state_machine_as_test", broken_by_the_signal)
    try:
        with pytest.raises(KeyboardInterrupt) as stopped:
            campaigns.run_campaign(campaigns.Campaign(EpisodeConfig(zeroer="reference", kernel="torch")),
                                   campaigns.PROFILES["quick"], tmp_path)
    finally:
        interrupts.reset()
    assert type(stopped.value) is KeyboardInterrupt and isinstance(stopped.value.__cause__, AssertionError)

    def failing(*args, **kwargs):
        raise AssertionError

    monkeypatch.setattr(campaigns, "run_state_machine_as_test", failing)
    with pytest.raises(AssertionError):  # with no signal, a failure stays the failure it is
        campaigns.run_campaign(campaigns.Campaign(EpisodeConfig(zeroer="reference", kernel="torch")),
                               campaigns.PROFILES["quick"], tmp_path)


STARTING_UP = """
import os, signal, sys
from racecheck import interrupts
interrupts.install(until_started=True)
if sys.argv[1] == "after":
    interrupts.started()
try:
    os.kill(os.getpid(), signal.SIG{name})
    signal.pause() if hasattr(signal, "pause") else None
except KeyboardInterrupt as stopped:
    print("KeyboardInterrupt:", stopped, interrupts.interrupted())
    sys.exit(2)
"""


@pytest.mark.parametrize("name", ["INT", "TERM"])
def test_an_interrupt_while_plugins_still_import_ends_the_process_by_its_signal_and_after_start_up_raises(name):
    """During start-up a KeyboardInterrupt lands in some plugin's import, where Python may turn it
    into another error (pytest then said "internal error", exit 3, in CI); nothing has run yet, so
    the process ends by the signal. Once started, the usual KeyboardInterrupt."""
    code = STARTING_UP.replace("{name}", name)
    before = subprocess.run([sys.executable, "-c", code, "before"], cwd=ROOT, env=clean_env(ROOT),
                            capture_output=True, text=True, timeout=60)
    assert before.returncode == -getattr(signal, f"SIG{name}") and not before.stdout, before
    after = subprocess.run([sys.executable, "-c", code, "after"], cwd=ROOT, env=clean_env(ROOT),
                           capture_output=True, text=True, timeout=60)
    assert after.returncode == 2 and after.stdout == f"KeyboardInterrupt: stopped by SIG{name} True\n", after


STUCK_OFFLOADER = """
import os, sys, threading
sys.path.insert(0, {examples!r})
from engine_offloaders import CopyThreadOffloader
READ_END, _WRITE_END = os.pipe()  # nothing is ever written: a read of it never returns

class StuckWriter(CopyThreadOffloader):
    def store(self, job_id, block_ids, slot_ids):
        super().store(job_id, block_ids, slot_ids)
        # Not a daemon: the interpreter waits for it at exit.
        threading.Thread(target=self._write_back, name="kv-writer").start()

    def _write_back(self):
        open({marker!r}, "w").close()
        # A native call that never returns and is no hand-off the hooks see: on a GPU, a copy
        # thread's synchronous copy waiting behind a gate kernel nobody will open.
        os.read(READ_END, 1)

def make(cache, host_pool, runtime=None):
    return StuckWriter(cache, host_pool)
"""


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT"])
def test_a_run_stuck_in_a_native_call_ends_within_ten_seconds_of_a_signal_with_every_stack(tmp_path, how):
    # The caller waits for the writer thread to settle, and the writer never comes back from its
    # native call; the KeyboardInterrupt unwinds the caller, and the interpreter then waits for the
    # thread at exit, for ever (on an H100 such a run was still there 440 s after SIGTERM). The
    # interruption's deadline ends it.
    marker = tmp_path / "stuck"
    source = tmp_path / "stuck_offloader.py"
    source.write_text(STUCK_OFFLOADER.format(examples=str(ROOT / "examples"), marker=str(marker)))
    args = ["fuzz", "-p", "no:cacheprovider", "-p", "no:xdist", "--backend", "sim", "--offloader", f"{source}:make",
            "--fuzz-profile", "quick", "-x", "--repro-dir", str(tmp_path / "traces"),
            "--fuzz-summary", str(tmp_path / "summary.json"), "--fuzz-db", str(tmp_path / "db")]
    run = start_subprocess(ROOT, clean_env(ROOT), args, tmp_path / "out.txt")
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline and run.wait(0.1) is None:
            pass
        assert marker.exists(), run.text()[-3000:]
        sent = time.monotonic()
        os.kill(run.pid, getattr(signal, how))
        ended = run.wait(timeout=15)
        assert ended is not None, f"still running 15 s after {how}:\n{run.text()[-3000:]}"
        code, at = ended
        text = run.text()
        assert at - sent <= 10, (at - sent, text[-3000:])
        assert code == 2, (code, text[-3000:])  # interrupted, nothing found: never 1, never 0
        assert f"s after {how}: ending the process by force; each thread was here:" in text
        assert "in _write_back" in text  # the stuck thread's stack says where it was
        assert not (tmp_path / "summary.json").exists()  # no complete summary from a run cut short
    finally:
        run.kill_group()
