"""Real ``pytest fuzz`` processes that a test can signal, kill and wait for (tests/test_interrupts.py).

Every ``python -m pytest`` process spends about 4 s of CPU importing torch, Hypothesis and the
plugin before it runs anything, which would make fifty signalled runs cost minutes on a 2-core
machine. So most runs are forked from a :class:`Forker`: one process that has done those imports
once and forks a child per run, and the child runs ``pytest.main(args)`` exactly as ``python -m
pytest args`` would (pytest-xdist workers are started by execnet as fresh interpreters either
way). One difference: the plugin installs its signal handlers when it is imported, so a forked run
has them from its first instruction, while a plain process has Python's own SIGINT handler for its
first fraction of a second (see :func:`tests.test_interrupts.dropped_by_python`). A run can also be
a plain ``python -m pytest`` subprocess (:func:`start_subprocess`), which is what the import-time
points and the killed-worker tests use.

Each run is the leader of its own process group, as a command started from a terminal is:
``os.killpg(run.pid, SIGINT)`` is Ctrl-C (it reaches pytest-xdist's workers too), ``os.kill``
reaches the controller alone (``kill PID``, a CI runner's cancel).

Example::

    forker = Forker(ROOT, env)
    run = forker.start(["fuzz", "-p", "no:xdist", "--backend", "sim", ...], tmp_path / "out.txt")
    os.kill(run.pid, signal.SIGTERM)
    code, exited_at = run.wait(timeout=30)
    forker.close()
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

# The forking process: imports once, then forks one child per request line on stdin and reports
# {"started": pid} at once and {"exited": pid, "code": ..., "at": time.monotonic()} when it
# reaps it (CLOCK_MONOTONIC is one clock for every process of the machine).
FORKER = r"""
import json, os, select, sys, time
import hypothesis, pytest, torch, xdist.plugin
import fuzz.plugin  # the imports every pytest fuzz process makes, done once here

def child(request):
    os.setsid()  # its own process group, as a terminal gives a command
    fd = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.argv = ["pytest", *request["args"]]
    code = pytest.main(request["args"])
    sys.stdout.flush()
    sys.stderr.flush()
    # Not the interpreter's teardown: after a fork it writes to every page the imports made
    # (copy on write) and takes seconds; the plain python -m pytest runs measure a real one.
    os._exit(int(code))

reported = sys.stdout
running = set()
while True:
    ready, _, _ = select.select([sys.stdin], [], [], 0.02)
    if ready:
        line = sys.stdin.readline()
        if not line:
            break
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            child(request)
        running.add(pid)
        reported.write(json.dumps({"started": pid}) + "\n")
        reported.flush()
    for pid in list(running):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            running.discard(pid)
            reported.write(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status), "at": time.monotonic()}) + "\n")
            reported.flush()
for pid in running:
    os.waitpid(pid, 0)
"""


class Run:
    """One pytest process: its pid (also its process group) and a way to wait for its exit."""

    def __init__(self, pid: int, output: Path, wait) -> None:
        self.pid = pid
        self.output = output
        self._wait = wait

    def wait(self, timeout: float) -> tuple[int, float] | None:
        """(exit code, time.monotonic() of the exit), or None if it is still running after ``timeout``."""
        return self._wait(timeout)

    def group_alive(self) -> list[int]:
        """The processes of its group (pytest-xdist workers included) still running (zombies,
        which only wait to be reaped, do not count)."""
        return group_members(self.pid)

    def kill_group(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def text(self) -> str:
        try:
            return self.output.read_text(errors="replace")
        except FileNotFoundError:
            return ""


class Forker:
    """A process that has imported what ``pytest fuzz`` needs and forks one run per :meth:`start`."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-c", FORKER], cwd=root, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        self._lock = threading.Lock()
        self._started: queue.Queue[int] = queue.Queue()
        self._exits: dict[int, tuple[int, float]] = {}
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._process.stdout:
            message = json.loads(line)
            if "started" in message:
                self._started.put(message["started"])
            else:
                with self._changed:
                    self._exits[message["exited"]] = (message["code"], message["at"])
                    self._changed.notify_all()
        with self._changed:  # the forker itself is gone
            self._changed.notify_all()

    def start(self, args: list[str], output: Path) -> Run:
        with self._lock:  # one request at a time, so the pid that comes back is this one's
            self._process.stdin.write(json.dumps({"args": args, "out": str(output)}) + "\n")
            self._process.stdin.flush()
            pid = self._started.get(timeout=60)
        return Run(pid, output, lambda timeout: self._wait(pid, timeout))

    def _wait(self, pid: int, timeout: float) -> tuple[int, float] | None:
        deadline = time.monotonic() + timeout
        with self._changed:
            while pid not in self._exits:
                left = deadline - time.monotonic()
                if left <= 0 or self._process.poll() is not None:
                    return None
                self._changed.wait(left)
            return self._exits[pid]

    def close(self) -> None:
        self._process.stdin.close()
        try:
            self._process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._process.kill()


def start_subprocess(root: Path, env: dict[str, str], args: list[str], output: Path) -> Run:
    """A plain ``python -m pytest ARGS`` in its own process group."""
    handle = open(output, "w")
    process = subprocess.Popen([sys.executable, "-m", "pytest", *args], cwd=root, env=env, stdout=handle,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    handle.close()
    exited: list[tuple[int, float]] = []

    def reap() -> None:
        code = process.wait()
        exited.append((code, time.monotonic()))

    reaper = threading.Thread(target=reap, daemon=True)
    reaper.start()

    def wait(timeout: float) -> tuple[int, float] | None:
        reaper.join(timeout)
        return exited[0] if exited else None

    return Run(process.pid, output, wait)


def group_members(group: int) -> list[int]:
    """Live (not zombie) processes of process group ``group``, from /proc (Linux)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, pgrp, ...
        if int(fields[2]) == group and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


STACK_DUMPS = Path(__file__).with_name("stack_dumps")  # its sitecustomize.py: SIGUSR1 writes every stack


def clean_env(root: Path, stacks: Path | None = None) -> dict[str, str]:
    """The environment of a run: this checkout on the path, none of the outer pytest's variables.
    With ``stacks`` (a folder), each Python process of the run writes its threads' stacks to
    ``stacks/<pid>.txt`` on SIGUSR1 (:func:`dump_stacks`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(root), *([str(STACK_DUMPS)] if stacks else []), env.get("PYTHONPATH", "")])
    if stacks is not None:
        stacks.mkdir(parents=True, exist_ok=True)
        env["KVZERO_TEST_STACKS"] = str(stacks)
    return env


def dump_stacks(run: Run, stacks: Path) -> str:
    """Where each live process of ``run`` is now: every thread's stack, asked for with SIGUSR1 (the
    processes go on running). Empty if none is alive."""
    members = sorted(set(run.group_alive()))
    for pid in members:
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    time.sleep(1.0)  # faulthandler writes from the signal handler, at once; leave it time on a busy machine
    parts = []
    for pid in members:
        path = stacks / f"{pid}.txt"
        text = path.read_text(errors="replace") if path.exists() else "(no stack file: the process had not started Python)"
        parts.append(f"--- process {pid} ---\n{text.strip()}")
    return "\n".join(parts)
