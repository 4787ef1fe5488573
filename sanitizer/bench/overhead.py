"""What the sanitizer costs: the same test suites plainly, with ``--kvz-sanitize`` and under
PyTorch's sanitizer, side by side.

Two small suites stand for the two kinds of test suite an engine has
(:mod:`sanitizer.bench.suites`): ``gpu_bound`` (a few large matmuls per test: the GPU sets the
pace) and ``launch_bound`` (hundreds of tiny ops and a pinned staging copy per step: the host
sets it, and every op passes the sanitizer's hooks). Each round runs each suite plainly, under
this sanitizer and under PyTorch's (``TORCH_CUDA_SANITIZER=1``), in fresh pytest processes, each
round starting one run later than the last (:func:`rotated`); a ratio is the median over rounds
of a tool's time over the plain time of the same round, for the whole process (wall) and for the
tests alone (the sum of the tests' durations in pytest's JUnit XML, without the interpreter's and
torch's start-up). A round's JSON says its order. The goals (issue 54) are this
sanitizer's: wall time at most 1.2x on both suites; the tests alone at most 1.5x on the
launch-bound suite and 1.1x on the GPU-bound one. PyTorch's column is for comparison; a suite it
fails (it raises on what it takes for a race) is recorded as failed, with its last lines.

Run it (needs a GPU; about 70 s a round on an H100)::

    python -m sanitizer.bench.overhead --rounds 3 --json h100-sanitizer-overhead-$(date +%Y-%m).json

Exit status (:mod:`racecheck.cli`): 0 when this sanitizer met every goal, 1 when it missed one, 2 for
a bad command line or a machine without a GPU, 3 when a suite failed plainly (the benchmark's error).
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from statistics import median
from typing import Any

from racecheck.atomic_file import write_json_atomically
from racecheck.cli import CLEAN, FINDING, ArgumentParser, UsageError, check_output, run_main
from racecheck.environment import environment

SUITES = Path(__file__).with_name("suites")
GOALS = {"gpu_bound": 1.2, "launch_bound": 1.2}  # this sanitizer's wall time over plain (issue 54)
TEST_GOALS = {"gpu_bound": 1.1, "launch_bound": 1.5}  # the tests alone
TOOLS = ("kvz", "torch")  # ours (--kvz-sanitize), PyTorch's (TORCH_CUDA_SANITIZER=1)


class SuiteFailed(RuntimeError):
    """A suite's pytest process exited non-zero; the message is its command and last lines."""


def run_suite(suite: str, flags: list[str], scratch: Path, env: dict[str, str] | None = None) -> dict[str, float]:
    junit = scratch / f"{suite}-{len(flags)}-{time.monotonic_ns()}.xml"
    # Not named test_*.py, so that `pytest fuzz` never collects them; named on the command line, pytest does.
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "fuzz.plugin", "-p",
               "sanitizer.pytest_plugin",
               "--rootdir", str(SUITES), "-c", os.devnull, f"--junitxml={junit}", *flags, str(SUITES / f"{suite}.py")]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=None if env is None else {**os.environ, **env})
    wall = time.perf_counter() - started
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
        raise SuiteFailed(f"suite {suite} {' '.join(flags) or '(plain)'}{' ' + str(env) if env else ''} "
                          f"exited {done.returncode}: {' | '.join(tail)}")
    try:
        tests = sum(float(case.get("time", 0)) for case in ElementTree.parse(junit).getroot().iter("testcase"))
    except (OSError, ElementTree.ParseError) as unreadable:
        raise SuiteFailed(f"suite {suite} {' '.join(flags) or '(plain)'}: no JUnit XML to read ({unreadable})") from None
    return {"wall": wall, "tests": tests}


def judge(suite: str, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The ratios of ``rounds`` (each: ``plain`` and every tool's timings, or a tool's ``{"failed":
    why}``) and whether this sanitizer met the suite's goals. A tool that failed any round has no
    ratio; this sanitizer failing a round never meets a goal."""
    result: dict[str, Any] = {"rounds": rounds, "goal": GOALS[suite], "tests_goal": TEST_GOALS[suite]}
    ratios: dict[str, float | None] = {}
    for tool in TOOLS:
        timed = [r for r in rounds if tool in r and "failed" not in r[tool]]
        complete = bool(rounds) and len(timed) == len(rounds)
        for what in ("wall", "tests"):
            usable = complete and all(r["plain"][what] > 0 for r in timed)
            ratio = median(r[tool][what] / r["plain"][what] for r in timed) if usable else None
            ratios[f"{tool}_{what}"] = ratio
            result[f"{tool}_{what}_ratio"] = None if ratio is None else round(ratio, 2)
    wall, tests = ratios["kvz_wall"], ratios["kvz_tests"]  # judged unrounded: 1.204 misses 1.2
    result["met"] = wall is not None and tests is not None and wall <= GOALS[suite] and tests <= TEST_GOALS[suite]
    return result


def line(suite: str, result: dict[str, Any], rounds: int) -> str:
    """One line of the table: this sanitizer's ratios against the goals, PyTorch's beside them."""
    def ratio(value: float | None) -> str:
        return "failed" if value is None else f"{value:.2f}x"

    return (f"{suite}: kvz wall {ratio(result['kvz_wall_ratio'])} (goal {GOALS[suite]}x), tests alone "
            f"{ratio(result['kvz_tests_ratio'])} (goal {TEST_GOALS[suite]}x): {'met' if result['met'] else 'missed'}; "
            f"PyTorch's sanitizer wall {ratio(result['torch_wall_ratio'])}, tests alone "
            f"{ratio(result['torch_tests_ratio'])}; median of {rounds} rounds")


def rotated(names: list[str], index: int) -> list[str]:
    """The order of round ``index``: each round starts one later, so that no tool always runs first
    (the first process of a round may meet a colder GPU, a colder page cache)."""
    shift = index % len(names)
    return names[shift:] + names[:shift]


def _timed(suite: str, flags: list[str], scratch: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    try:
        return run_suite(suite, flags, scratch, env)
    except SuiteFailed as failed:
        return {"failed": str(failed)}


def _main(argv: list[str]) -> int:
    p = ArgumentParser(prog="python -m sanitizer.bench.overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--flags", default="--kvz-sanitize", help="the sanitizer's flags (default --kvz-sanitize)")
    p.add_argument("--json", help="write the measurements here")
    args = p.parse_args(argv)
    out = check_output("--json", args.json)
    if args.rounds < 1:
        raise UsageError(f"--rounds {args.rounds}: give at least 1")
    import torch

    if not torch.cuda.is_available():
        raise UsageError("the overhead benchmark needs a GPU (its suites run on cuda)")
    flags = args.flags.split()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvz-overhead-") as scratch:
        run_suite("launch_bound", [], Path(scratch))  # warm caches (Triton, torch kernels) once
        for suite in GOALS:
            rounds = []
            for index in range(args.rounds):
                runs = {
                    "plain": lambda: run_suite(suite, [], Path(scratch)),  # failing plainly: the benchmark's error
                    "kvz": lambda: _timed(suite, flags, Path(scratch)),
                    "torch": lambda: _timed(suite, [], Path(scratch), {"TORCH_CUDA_SANITIZER": "1"}),
                }
                round_: dict[str, Any] = {"order": rotated(list(runs), index)}
                for name in round_["order"]:
                    round_[name] = runs[name]()
                rounds.append(round_)
            results[suite] = judge(suite, rounds)
            print(line(suite, results[suite], args.rounds))
            for tool in TOOLS:
                for failed in {r[tool]["failed"] for r in rounds if "failed" in r[tool]}:
                    print(f"  {tool}: {failed}")
    if out is not None:
        write_json_atomically(out, {"command": "python -m sanitizer.bench.overhead " + " ".join(argv),
                                    "date": datetime.date.today().isoformat(), "environment": environment(),
                                    "flags": flags, "suites": results})
    return CLEAN if all(r["met"] for r in results.values()) else FINDING


def main(argv: list[str] | None = None) -> int:
    return run_main(_main, argv, "python -m sanitizer.bench.overhead")


if __name__ == "__main__":
    sys.exit(main())
