"""What the sanitizer costs: the same test suites with and without ``--kvz-sanitize``, side by side.

Two small suites stand for the two kinds of test suite an engine has
(:mod:`sanitizer.bench.suites`): ``gpu_bound`` (a few large matmuls per test: the GPU sets the
pace) and ``launch_bound`` (hundreds of tiny ops and a pinned staging copy per step: the host
sets it, and every op passes the sanitizer's hooks). Each round runs each suite plainly and under
the sanitizer, in fresh pytest processes, alternating; a ratio is the median over rounds of
sanitized time over plain time, for the whole process (wall) and for the tests alone (the sum of
the tests' durations in pytest's JUnit XML, without the interpreter's and torch's start-up).
Goals (issue 30): wall time at most 1.5x on both suites; the tests alone (process start-up left
out) at most 1.1x on the GPU-bound suite and 2x on the launch-bound one.

Run it (needs a GPU; about 50 s a round on an H200)::

    python -m sanitizer.bench.overhead --rounds 3 --json h200-sanitizer-overhead-$(date +%Y-%m).json
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
from typing import Any

from racecheck.atomic_file import write_json_atomically
from statistics import median
from racecheck.cli import CLEAN, ArgumentParser, UsageError, check_output, run_main
from racecheck.environment import environment

SUITES = Path(__file__).with_name("suites")
GOALS = {"gpu_bound": 1.5, "launch_bound": 1.5}  # wall time (issue 30)
TEST_GOALS = {"gpu_bound": 1.1, "launch_bound": 2.0}  # the tests alone


def run_suite(suite: str, flags: list[str], scratch: Path) -> dict[str, float]:
    junit = scratch / f"{suite}-{len(flags)}-{time.monotonic_ns()}.xml"
    # Not named test_*.py, so that `pytest fuzz` never collects them; named on the command line, pytest does.
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "fuzz.plugin", "-p",
               "sanitizer.pytest_plugin",
               "--rootdir", str(SUITES), "-c", os.devnull, f"--junitxml={junit}", *flags, str(SUITES / f"{suite}.py")]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
        raise RuntimeError(f"suite {suite} {' '.join(flags) or '(plain)'} exited {done.returncode}: {' | '.join(tail)}")
    tests = sum(float(case.get("time", 0)) for case in ElementTree.parse(junit).getroot().iter("testcase"))
    return {"wall": wall, "tests": tests}


def _main(argv: list[str]) -> int:
    p = ArgumentParser(prog="python -m sanitizer.bench.overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--flags", default="--kvz-sanitize", help="the sanitizer's flags (default --kvz-sanitize)")
    p.add_argument("--json", help="write the measurements here")
    args = p.parse_args(argv)
    out = check_output("--json", args.json)
    import torch

    if not torch.cuda.is_available():
        raise UsageError("the overhead benchmark needs a GPU (its suites run on cuda)")
    flags = args.flags.split()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvz-overhead-") as scratch:
        run_suite("launch_bound", [], Path(scratch))  # warm caches (Triton, torch kernels) once
        for suite in GOALS:
            rounds = []
            for _ in range(args.rounds):
                plain = run_suite(suite, [], Path(scratch))
                sanitized = run_suite(suite, flags, Path(scratch))
                rounds.append({"plain": plain, "sanitized": sanitized})
            wall = median([r["sanitized"]["wall"] / r["plain"]["wall"] for r in rounds])
            tests = median([r["sanitized"]["tests"] / r["plain"]["tests"] for r in rounds])
            met = wall <= GOALS[suite] and tests <= TEST_GOALS[suite]
            results[suite] = {"rounds": rounds, "wall_ratio": round(wall, 2), "tests_ratio": round(tests, 2),
                              "goal": GOALS[suite], "tests_goal": TEST_GOALS[suite], "met": met}
            print(f"{suite}: wall {wall:.2f}x (goal {GOALS[suite]}x), tests alone {tests:.2f}x (goal "
                  f"{TEST_GOALS[suite]}x): {'met' if met else 'missed'}, median of {args.rounds} rounds")
    if out is not None:
        write_json_atomically(out, {"command": "python -m sanitizer.bench.overhead " + " ".join(argv),
                                    "date": datetime.date.today().isoformat(), "environment": environment(),
                                    "flags": flags, "suites": results})
    return CLEAN


def main(argv: list[str] | None = None) -> int:
    return run_main(_main, argv, "python -m sanitizer.bench.overhead")


if __name__ == "__main__":
    sys.exit(main())
